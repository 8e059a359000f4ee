package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/discovery"
)

// newPeersCmd is `tandem peers`: a browse of the LAN, no daemon needed.
func newPeersCmd() *cobra.Command {
	var (
		timeout time.Duration
		asJSON  bool
		iface   string
	)
	cmd := &cobra.Command{
		Use:   "peers",
		Short: "List the tandem gateways on the LAN (mDNS)",
		Long: "List the tandem gateways that answer on the LAN over mDNS within the timeout. " +
			"Needs no running daemon; goes through avahi-daemon where one runs.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if timeout <= 0 {
				return config.UsageError{Err: errors.New("--timeout must be positive")}
			}
			peers, err := discovery.Browse(cmd.Context(), discovery.BrowseOptions{Interface: iface, Timeout: timeout})
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(peers)
			}
			writePeersTable(cmd.OutOrStdout(), peers)
			return nil
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&timeout, "timeout", discovery.DefaultBrowseTimeout, "how long to listen for answers")
	fl.BoolVar(&asJSON, "json", false, "print a JSON list")
	fl.StringVar(&iface, "interface", "", "LAN interface to browse on (default: the system's choice)")
	return cmd
}

// writePeersTable prints peers for a person; ids in their short form.
func writePeersTable(w io.Writer, peers []discovery.Peer) {
	if len(peers) == 0 {
		fmt.Fprintln(w, "no tandem gateways found")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tID\tCLUSTER\tGEN\tROLE\tTERM\tADDRESSES\tMQTT\tVERSION\tPAIRING")
	for _, p := range peers {
		id := p.ID
		if len(id) > 8 {
			id = id[:8]
		}
		cluster, pair := p.Cluster, ""
		if cluster == "" {
			cluster = "-"
		}
		if p.PairOpen {
			pair = "open"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\t%d\t%s\t%s\n", p.Name, id, cluster, p.Gen, p.Role, p.Term,
			strings.Join(p.Addrs, ","), p.MQTTPort, p.Version, pair)
	}
	tw.Flush()
}
