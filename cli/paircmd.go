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
)

// newPairCmd is `tandem pair open|join`.
func newPairCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pair",
		Short: "Pair gateways on site with a short code (open on a member, join on the new gateway)",
		Long: "Pair gateways on the same LAN without copying tokens: `tandem pair open` on a member prints a short code; " +
			"`tandem pair join CODE` on the new gateway finds that cluster over mDNS and joins it. Both need discovery.mdns on.",
	}
	var of apiFlags
	var ttl time.Duration
	open := &cobra.Command{
		Use:   "open",
		Short: "Print a one-time pairing code (run on any member; the master holds it)",
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if ttl <= 0 || ttl > admin.MaxPairTTL {
				return config.UsageError{Err: fmt.Errorf("--ttl %v: a duration up to %v", ttl, admin.MaxPairTTL)}
			}
			var out admin.PairOpenResponse
			if err := of.call("/v1/pair/open", admin.PairOpenRequest{TTL: ttl.String()}, &out); err != nil {
				return err
			}
			fmt.Fprintln(c.OutOrStdout(), out.Code)
			fmt.Fprintf(c.ErrOrStderr(), "pairing open until %s, for one gateway: run `tandem pair join %s` on it\n", out.Expires, out.Code)
			return nil
		},
	}
	open.Flags().DurationVar(&ttl, "ttl", cluster.DefaultPairTTL, "how long the code stays valid")
	of.add(open)

	var jf apiFlags
	var requeue, discard bool
	var timeout time.Duration
	var addr string
	join := &cobra.Command{
		Use:   "join CODE",
		Short: "Make this gateway a member of the cluster whose member printed CODE",
		Long: "Make this gateway a member of the cluster that opened pairing with CODE, found on the LAN over mDNS. " +
			"Both gateways prove they know the code before anything changes. A gateway whose log holds records must say " +
			"what becomes of them: --requeue publishes them into the cluster, --discard drops them.",
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			if requeue && discard {
				return config.UsageError{Err: errors.New("--requeue and --discard exclude each other")}
			}
			if timeout <= 0 || timeout > admin.MaxPairBrowse {
				return config.UsageError{Err: fmt.Errorf("--timeout %v: a duration up to %v", timeout, admin.MaxPairBrowse)}
			}
			if _, err := cluster.ParsePairCode(args[0]); err != nil {
				return config.UsageError{Err: err}
			}
			req := admin.PairJoinRequest{Code: args[0], Timeout: timeout.String(), Addr: addr}
			if requeue {
				req.Mode = admin.JoinRequeue
			} else if discard {
				req.Mode = admin.JoinDiscard
			}
			var out admin.JoinResponse
			if err := jf.call("/v1/pair/join", req, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "paired: joined cluster %s (master %s; members %s)%s\n", out.Cluster, out.Master, strings.Join(out.Members, ", "), joinedAs(out))
			return nil
		},
	}
	join.Flags().BoolVar(&requeue, "requeue", false, "publish this gateway's records into the cluster")
	join.Flags().BoolVar(&discard, "discard", false, "drop this gateway's records")
	join.Flags().DurationVar(&timeout, "timeout", admin.DefaultPairBrowse, "how long to look on the LAN for the gateway with pairing open")
	join.Flags().StringVar(&addr, "addr", "", "knock on this HOST:PORT (the other gateway's peer port) instead of looking over mDNS")
	jf.add(join)

	cmd.AddCommand(open, join)
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
