package cli

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/tandem-edge/tandem/admin"
)

// newUplinkCmd is `tandem uplink pause|resume NAME`: the field engineer
// who needs the cellular link for something else holds an uplink back.
func newUplinkCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "uplink",
		Short: "Pause or resume an uplink to a cloud broker",
		Long: "Pause closes an uplink's connection and keeps it closed until resume; the backlog grows meanwhile, " +
			"within max_backlog. Run it on any member: the pause is logged, so it holds on every member, " +
			"across restarts and failovers, until resume.",
	}
	for _, verb := range []string{"pause", "resume"} {
		var af apiFlags
		sub := &cobra.Command{
			Use:   verb + " NAME",
			Short: map[string]string{"pause": "Close an uplink's connection until resume", "resume": "Let a paused uplink connect again"}[verb],
			Args:  cobra.ExactArgs(1),
			RunE: func(c *cobra.Command, args []string) error {
				var out admin.UplinkResponse
				if err := af.call("/v1/uplink/"+verb, admin.UplinkRequest{Name: args[0]}, &out); err != nil {
					return err
				}
				state := "resumed: it connects again"
				if out.Paused {
					state = "paused: its backlog grows until `tandem uplink resume " + out.Name + "`"
				}
				fmt.Fprintf(c.OutOrStdout(), "uplink %s %s\n", out.Name, state)
				return nil
			},
		}
		af.add(sub)
		cmd.AddCommand(sub)
	}
	return cmd
}

// writeUplinks prints the uplinks of s, if any, for `tandem status`.
func writeUplinks(w io.Writer, s *admin.Status) error {
	if len(s.Uplinks) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "UPLINK\tSTATE\tSINCE\tBACKLOG RECORDS\tBACKLOG BYTES\tOLDEST\tRATE/S\tETA\tLAST ERROR")
	for _, u := range s.Uplinks {
		state := "disconnected"
		switch {
		case !u.Running:
			state = "idle (not master)"
		case u.Paused:
			state = "paused"
		case u.Connected:
			state = "connected"
		}
		if u.Full {
			state += ", FULL"
		}
		since := "-"
		if u.Since != nil {
			since = u.Since.Local().Format(time.DateTime)
		}
		eta := "-"
		if u.ReplayETASeconds != nil {
			eta = (time.Duration(*u.ReplayETASeconds) * time.Second).String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%.1f\t%s\t%s\n", u.Name, state, since, u.BacklogRecords,
			admin.FormatBytes(uint64(u.BacklogBytes)), (time.Duration(u.OldestAgeSeconds) * time.Second).String(), u.Rate, eta, admin.OrDash(u.LastError))
	}
	return tw.Flush()
}
