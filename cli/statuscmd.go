package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/tandem-edge/tandem/admin"
)

// defaultHTTP is where the CLI finds the daemon when told nothing else:
// DefaultConfig's http.listen.
const defaultHTTP = "127.0.0.1:7880"

// newStatusCmd is `tandem status`.
func newStatusCmd() *cobra.Command {
	var af apiFlags
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the running gateway's status",
		Long: "Show the running gateway's status: node, role, term and master, the other members with their lag,\n" +
			"the log's indexes, disk use and connected clients. It asks the daemon over its HTTP listener\n" +
			"(--http, or http.listen of --config, default " + defaultHTTP + ").",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			addr, body, err := af.getStatus()
			if err != nil {
				return err
			}
			if asJSON {
				_, err = cmd.OutOrStdout().Write(body)
				return err
			}
			var s admin.Status
			if err := json.Unmarshal(body, &s); err != nil {
				return fmt.Errorf("the daemon at %s answered with a status this version cannot read: %w", addr, err)
			}
			return writeStatus(cmd.OutOrStdout(), &s)
		},
	}
	af.add(cmd)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status JSON as the daemon serves it")
	return cmd
}

// writeStatus prints s for a person: this node first, then the members.
func writeStatus(w io.Writer, s *admin.Status) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	leader := "none"
	if s.Leader != nil {
		leader = admin.NameOr(s.Leader.Name, s.Leader.ID) + " (" + admin.ShortID(s.Leader.ID) + ")"
	} else if len(s.Members) > 0 {
		leader = "none reachable"
	}
	fmt.Fprintf(tw, "node\t%s (%s), tandem %s\n", s.Node.Name, admin.ShortID(s.Node.ID), s.Node.Version)
	fmt.Fprintf(tw, "role\t%s, term %d\n", s.Role, s.Term)
	fmt.Fprintf(tw, "master\t%s\n", leader)
	if s.Serving != "" {
		// A daemon of an earlier release sends no serving field.
		serving := s.Serving
		if s.NotServing != nil {
			serving = "NOT TAKING PUBLISHES (" + s.Serving + "): " + *s.NotServing
		}
		fmt.Fprintf(tw, "serving\t%s\n", serving)
	}
	if s.Cluster.ID != "" {
		fmt.Fprintf(tw, "cluster\t%s, generation %d\n", admin.ShortID(s.Cluster.ID), s.Cluster.Generation)
	}
	if s.Cluster.FeatureLevel > 0 {
		level := fmt.Sprintf("%d", s.Cluster.FeatureLevel)
		if s.Cluster.FeatureLevel < s.Cluster.FeatureLevelKnown {
			level += fmt.Sprintf(" (this build knows %d: raised once every member runs a build that does)", s.Cluster.FeatureLevelKnown)
		}
		fmt.Fprintf(tw, "feature level\t%s\n", level)
	}
	fmt.Fprintf(tw, "log\tfirst %d, last %d, committed %d, applied %d\n", s.Log.FirstIndex, s.Log.LastIndex, s.Log.CommitIndex, s.Log.AppliedIndex)
	disk := fmt.Sprintf("%s used, %s free", admin.FormatBytes(uint64(max(s.Disk.UsedBytes, 0))), admin.FormatBytes(s.Disk.FreeBytes))
	if s.Disk.BudgetBytes > 0 {
		disk += ", budget " + admin.FormatBytes(s.Disk.BudgetBytes)
	}
	if s.Storage.OldestAgeSeconds > 0 {
		disk += ", oldest record " + (time.Duration(s.Storage.OldestAgeSeconds) * time.Second).String() + " old"
	}
	if s.Storage.DroppedRecords > 0 {
		disk += fmt.Sprintf(", %d records dropped", s.Storage.DroppedRecords)
	}
	if s.Storage.Refusing != nil {
		disk += "; REFUSING PUBLISHES: " + *s.Storage.Refusing
	}
	fmt.Fprintf(tw, "disk\t%s\n", disk)
	fmt.Fprintf(tw, "clients\t%d connected, %d messages in flight\n", s.MQTT.Clients, s.MQTT.Inflight)
	pairing := "closed"
	if s.Pairing.Open {
		pairing = "open"
		if s.Pairing.Expires != nil {
			pairing += " until " + s.Pairing.Expires.Local().Format(time.TimeOnly)
		}
	}
	fmt.Fprintf(tw, "pairing\t%s\n", pairing)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	if len(s.Members) == 0 {
		if _, err := fmt.Fprintln(w, "members: none (a lone gateway)"); err != nil {
			return err
		}
		return writeUplinks(w, s)
	}
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MEMBER\tID\tROLE\tVOTER\tADDRESS\tREACHABLE\tMATCH\tLAG RECORDS\tLAG SECONDS\tVERSION")
	unknown := false
	for _, m := range s.Members {
		reach := "yes"
		match, lagRecs, lagSecs := fmt.Sprint(m.MatchIndex), fmt.Sprint(m.LagRecords), fmt.Sprintf("%.2f", m.LagSeconds)
		if !m.MatchKnown {
			// Only the master knows how much of the log the others
			// hold, and only once it heard from them.
			match, lagRecs, lagSecs = "?", "?", "?"
			unknown = true
		}
		if !m.Reachable {
			reach = "no"
			switch {
			case m.DownSince != nil:
				reach = "no, down since " + m.DownSince.Local().Format(time.TimeOnly) + " (" + time.Since(*m.DownSince).Round(time.Second).String() + ")"
			case s.Role != "master" && m.Role != "master":
				reach = "?" // a slave needs no link to the other slaves
			}
		}
		ver := admin.OrDash(m.Version)
		if m.FeatureLevel > 0 {
			ver += fmt.Sprintf(" (level %d)", m.FeatureLevel)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", admin.NameOr(m.Name, m.ID), admin.ShortID(m.ID), m.Role, yesNo(m.Voter),
			admin.OrDash(m.Addr), reach, match, lagRecs, lagSecs, ver)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if unknown {
		note := "? = not known to this gateway: the master has not heard from that member"
		if s.Role != "master" {
			note = "? = not known to this gateway: only the master knows how much of the log each member holds (tandem status on the master)"
		}
		if _, err := fmt.Fprintln(w, note); err != nil {
			return err
		}
	}
	return writeUplinks(w, s)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
