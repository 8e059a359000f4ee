package cli

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/cluster"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/daemon"
)

// newClusterCmd is `tandem cluster invite|join|remove`.
func newClusterCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "Grow or shrink the cluster of gateways (invite, join, remove)",
	}
	var af apiFlags
	var ttl time.Duration
	var loopback bool
	invite := &cobra.Command{
		Use:   "invite",
		Short: "Print a one-time join token for a new gateway (run on any member; the master issues it)",
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var out admin.InviteResponse
			req := admin.InviteRequest{}
			if ttl != 0 {
				req.TTL = ttl.String()
			}
			if err := af.call("/v1/cluster/invite", req, &out); err != nil {
				return err
			}
			// The embedded default keeps the peer port on loopback: a
			// token naming only 127.0.0.1 is of no use to the gateway
			// on another machine it is usually meant for. (It expires
			// unused.)
			if tok, _, err := cluster.ParseToken(out.Token, time.Now()); err == nil && daemon.LoopbackOnly(tok.Addrs) && !loopback {
				return daemon.LoopbackPeerError(tok.Addrs)
			}
			fmt.Fprintln(c.OutOrStdout(), out.Token)
			fmt.Fprintf(c.ErrOrStderr(), "valid until %s, for one gateway: run `tandem cluster join TOKEN` on it\n", out.Expires)
			return nil
		},
	}
	invite.Flags().DurationVar(&ttl, "ttl", cluster.DefaultInviteTTL, "how long the token stays valid")
	invite.Flags().BoolVar(&loopback, "loopback", false, "print the token even when the peer port is on loopback only (a second gateway on this machine)")
	af.add(invite)

	var jf apiFlags
	var requeue, discard bool
	join := &cobra.Command{
		Use:   "join TOKEN",
		Short: "Make this gateway a member of the cluster that issued TOKEN",
		Long: "Make this gateway a member of the cluster that issued TOKEN. A gateway whose log holds records must say what becomes of them: " +
			"--requeue publishes them into the cluster, --discard drops them. Once joined, the gateway takes in the cluster's history: " +
			"it replays the log, or, when the log no longer starts at its first record, installs the cluster's state (a snapshot) and then pulls " +
			"the records the master still holds before it. join shows that as a progress bar (records, bytes, rate, ETA) until it ends; " +
			"stopping join then stops only the display.",
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			if requeue && discard {
				return config.UsageError{Err: errors.New("--requeue and --discard exclude each other")}
			}
			req := admin.JoinRequest{Token: args[0]}
			if requeue {
				req.Mode = admin.JoinRequeue
			} else if discard {
				req.Mode = admin.JoinDiscard
			}
			if _, _, err := cluster.ParseToken(args[0], time.Now()); err != nil {
				return config.UsageError{Err: err}
			}
			var out admin.JoinResponse
			if err := jf.call("/v1/cluster/join", req, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "joined cluster %s (master %s; members %s)%s\n", out.Cluster, out.Master, strings.Join(out.Members, ", "), joinedAs(out))
			// The gateway takes in the cluster's history (a joiner to a
			// compacted log installs its state and pulls the records
			// before it): show how far.
			return showCatchUp(c.OutOrStdout(), &jf, out.CatchUpTo)
		},
	}
	join.Flags().BoolVar(&requeue, "requeue", false, "publish this gateway's records into the cluster")
	join.Flags().BoolVar(&discard, "discard", false, "drop this gateway's records")
	jf.add(join)

	var rf apiFlags
	var force bool
	remove := &cobra.Command{
		Use:   "remove NODE",
		Short: "Take a gateway (name or id) out of the cluster; its log is wiped",
		Long: `Take a gateway (name or id) out of the cluster. Run it on any member.

The removed gateway is told, wipes its copy of the log (its records are the
cluster's, which keeps them) and runs alone in a new cluster, ready for a new
invite. Refused: removing the master itself, the last voter, or, without
--force, the only slave while sync topics exist.`,
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			var out admin.RemoveResponse
			if err := rf.call("/v1/cluster/remove", admin.RemoveRequest{Node: args[0], Force: force}, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "removed %s\n", out.Removed)
			return nil
		},
	}
	remove.Flags().BoolVar(&force, "force", false, "remove it even if sync topics can then no longer be acked")
	rf.add(remove)

	cmd.AddCommand(invite, join, remove)
	for _, sub := range cmd.Commands() {
		args := sub.Args
		sub.Args = func(c *cobra.Command, a []string) error {
			if err := args(c, a); err != nil {
				return config.UsageError{Err: err}
			}
			return nil
		}
	}
	return cmd
}

// joinedAs says what the gateway became: with three members, a voter once
// promoted (join waits for it), or a learner still catching up.
func joinedAs(out admin.JoinResponse) string {
	switch {
	case len(out.Members) < 3:
		return "; this gateway is the slave"
	case out.Voter:
		return "; this gateway votes, as the others do: the cluster survives the loss of any one member"
	default:
		return "; a member is still catching up and votes once it has (tandem status shows it)"
	}
}
