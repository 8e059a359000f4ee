package daemon

import (
	"errors"

	"github.com/spf13/cobra"
)

// newPeersCmd is `tandem peers`.
func newPeersCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "peers",
		Short: "List the tandem gateways on the LAN (mDNS)",
		RunE:  func(*cobra.Command, []string) error { return errors.New("not implemented yet") },
	}
}
