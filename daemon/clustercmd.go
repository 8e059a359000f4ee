package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/replication"
)

// The cluster API: what `tandem cluster ...` asks of the running daemon
// (the requests and answers are admin's; see admin/api.go).

// registerClusterAPI adds the cluster commands' endpoints, behind the admin
// server's guard for endpoints that change the gateway.
func (d *Daemon) registerClusterAPI(srv *admin.Server) {
	srv.HandleMutating("/v1/cluster/invite", d.handleInvite)
	srv.HandleMutating("/v1/cluster/join", d.handleJoin)
	srv.HandleMutating("/v1/cluster/remove", d.handleRemove)
	srv.HandleMutating("/v1/cluster/promote", d.handlePromote)
	d.registerPairAPI(srv)
}

// statusOf maps an error to the status of its answer.
func statusOf(err error) int {
	var ue config.UsageError
	switch {
	case errors.As(err, &ue):
		return http.StatusBadRequest
	case errors.Is(err, errNoMaster):
		return http.StatusServiceUnavailable
	}
	return http.StatusConflict
}

func (d *Daemon) handleInvite(w http.ResponseWriter, r *http.Request) {
	var req admin.InviteRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	var ttl time.Duration
	if req.TTL != "" {
		var err error
		if ttl, err = time.ParseDuration(req.TTL); err != nil || ttl <= 0 || ttl > 7*24*time.Hour {
			admin.WriteError(w, http.StatusBadRequest, fmt.Errorf("ttl %q: a duration up to 168h", req.TTL))
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	rep, err := d.cl.admin(ctx, adminRequest{Op: "invite", TTL: ttl})
	if err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	tok, _, err := parseToken(rep.Token, time.Now())
	if err != nil {
		admin.WriteError(w, http.StatusInternalServerError, err)
		return
	}
	admin.WriteJSON(w, http.StatusOK, admin.InviteResponse{Token: rep.Token, Expires: time.Unix(tok.Expires, 0).UTC().Format(time.RFC3339)})
}

func (d *Daemon) handleJoin(w http.ResponseWriter, r *http.Request) {
	var req admin.JoinRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	mode, err := parseJoinMode(req.Mode)
	if err != nil {
		admin.WriteError(w, http.StatusBadRequest, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	rep, err := d.cl.join(ctx, req.Token, mode)
	if err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	out := admin.JoinResponse{Cluster: rep.Cluster, Master: rep.Master}
	for _, m := range rep.Members {
		out.Members = append(out.Members, m.Name)
	}
	admin.WriteJSON(w, http.StatusOK, out)
}

// parseJoinMode reads the mode of a join request.
func parseJoinMode(s string) (joinMode, error) {
	switch m := joinMode(s); m {
	case joinFresh, joinRequeue, joinDiscard:
		return m, nil
	}
	return "", fmt.Errorf("mode %q: requeue or discard", s)
}

func (d *Daemon) handleRemove(w http.ResponseWriter, r *http.Request) {
	var req admin.RemoveRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	if req.Node == "" {
		admin.WriteError(w, http.StatusBadRequest, errors.New("which node? give its name or id"))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	rep, err := d.cl.admin(ctx, adminRequest{Op: "remove", Node: req.Node, Force: req.Force})
	if err != nil {
		if errors.Is(err, replication.ErrLastVoter) {
			err = errors.New("cannot remove the last voter of the cluster")
		}
		admin.WriteError(w, statusOf(err), err)
		return
	}
	admin.WriteJSON(w, http.StatusOK, admin.RemoveResponse{Removed: rep.Removed})
}

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
			if tok, _, err := parseToken(out.Token, time.Now()); err == nil && loopbackOnly(tok.Addrs) && !loopback {
				return errLoopbackPeer(tok.Addrs)
			}
			fmt.Fprintln(c.OutOrStdout(), out.Token)
			fmt.Fprintf(c.ErrOrStderr(), "valid until %s, for one gateway: run `tandem cluster join TOKEN` on it\n", out.Expires)
			return nil
		},
	}
	invite.Flags().DurationVar(&ttl, "ttl", defaultInviteTTL, "how long the token stays valid")
	invite.Flags().BoolVar(&loopback, "loopback", false, "print the token even when the peer port is on loopback only (a second gateway on this machine)")
	af.add(invite)

	var jf apiFlags
	var requeue, discard bool
	join := &cobra.Command{
		Use:   "join TOKEN",
		Short: "Make this gateway a member of the cluster that issued TOKEN",
		Long: "Make this gateway a member of the cluster that issued TOKEN. A gateway whose log holds records must say what becomes of them: " +
			"--requeue publishes them into the cluster, --discard drops them.",
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			if requeue && discard {
				return config.UsageError{Err: errors.New("--requeue and --discard exclude each other")}
			}
			req := admin.JoinRequest{Token: args[0]}
			if requeue {
				req.Mode = string(joinRequeue)
			} else if discard {
				req.Mode = string(joinDiscard)
			}
			if _, _, err := parseToken(args[0], time.Now()); err != nil {
				return config.UsageError{Err: err}
			}
			var out admin.JoinResponse
			if err := jf.call("/v1/cluster/join", req, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "joined cluster %s (master %s; members %s)\n", out.Cluster, out.Master, strings.Join(out.Members, ", "))
			return nil
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
