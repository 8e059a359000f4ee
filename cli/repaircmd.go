package cli

import (
	"errors"

	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/repair"
)

func newRepairCmd() *cobra.Command {
	var dir string
	var opts repair.Options
	cmd := &cobra.Command{
		Use:   "repair --data DIR",
		Short: "Copy what can be read of a lone gateway's damaged data dir into new files",
		Long: `Repair the data dir of a lone gateway that refuses to start because its
storage fails its checks (a record that fails its CRC, a torn or truncated
data file, a damaged WAL).

Every record that can still be read is copied, at its own index, with the
raft state, the sessions, retained messages and cursors, the uplink
positions and the rest of the gateway's state, into new files. The records
that could not be read are named by index range (they become empty entries,
so every later index keeps its meaning), and so is every other part that
could not be read. The damaged files are kept, unchanged, in a folder
damaged/TIMESTAMP inside the data dir; the repaired ones take their place,
so the gateway starts as before (systemctl start tandem, or tandem run).

The gateway must be stopped: a data dir a running gateway holds is refused,
and so is one that passes its checks (nothing to repair). A member of a
cluster does not need this: started with storage.on_damage: resync it moves
its damaged files aside and re-syncs from its peers; --force repairs it as a
lone gateway anyway.

--accept-incomplete is the way out for a gateway whose broker state is
marked incomplete (status: "broker state incomplete"): a snapshot's install
was interrupted, and no master will ever send it again (a lone gateway, or
the slave of a master gone for good). It copies the data dir as above,
accepts the broker state as it is (retained messages, sessions and cursors
may be part from that snapshot, part older: it says so) and clears the
mark, so the gateway applies its log and takes devices again. A member of a
cluster waits for its master's snapshot instead; --force accepts its state
anyway.`,
		Example: `  sudo systemctl stop tandem
  sudo tandem repair --data /var/lib/tandem
  sudo systemctl start tandem

  # a lone gateway whose status says "broker state incomplete"
  sudo systemctl stop tandem
  sudo tandem repair --accept-incomplete --data /var/lib/tandem
  sudo systemctl start tandem`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" {
				return config.UsageError{Err: errors.New("repair needs --data DIR")}
			}
			err := repair.Run(cmd.OutOrStdout(), dir, opts)
			if errors.Is(err, repair.ErrHealthy) {
				return nil
			}
			return err
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&dir, "data", "", "the stopped gateway's data dir")
	fl.BoolVar(&opts.Force, "force", false, "repair a dir that passes its checks, or a cluster member's, too")
	fl.BoolVar(&opts.AcceptIncomplete, "accept-incomplete", false, "accept a broker state marked incomplete (an interrupted snapshot install) as it is, and clear the mark")
	return cmd
}
