package cli

import (
	"fmt"

	"github.com/spf13/cobra"
	"github.com/tandem-edge/tandem/admin"
)

// newPromoteCmd is `tandem promote`: the manual failover of a 2-gateway
// cluster, run on the slave.
func newPromoteCmd() *cobra.Command {
	var af apiFlags
	var force bool
	cmd := &cobra.Command{
		Use:   "promote",
		Short: "Make this slave the master of its 2-gateway cluster (the master is dead or gone)",
		Long: "Make this gateway, the slave of a 2-gateway cluster, its master: it becomes the only voter and the " +
			"cluster generation goes up. When the old master comes back it finds it was replaced, re-publishes " +
			"what it took after the fork on the new master, and rejoins as the slave. Refused while the master " +
			"is still in contact, unless --force.",
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var out admin.PromoteResponse
			if err := af.call("/v1/cluster/promote", admin.PromoteRequest{Force: force}, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "promoted: this gateway is the master (generation %d); %s is deposed and rejoins as slave when it returns\n", out.Generation, out.Deposed)
			return nil
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "promote even though the master is still in contact (two masters until it learns)")
	af.add(cmd)
	return cmd
}
