package daemon

import (
	"errors"

	"github.com/spf13/cobra"
)

// newStatusCmd is `tandem status`.
func newStatusCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "Show the running gateway's status",
		RunE:  func(*cobra.Command, []string) error { return errors.New("not implemented yet") },
	}
}
