package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
)

// The pairing API: what `tandem pair ...` asks of the running daemon. Same
// conventions as the cluster API (clustercmd.go).

type pairOpenRequest struct {
	TTL string `json:"ttl,omitempty"`
}

type pairOpenResponse struct {
	Code    string `json:"code"`
	Expires string `json:"expires"`
}

type pairJoinRequest struct {
	Code    string `json:"code"`
	Mode    string `json:"mode,omitempty"`    // "", "requeue" or "discard"
	Timeout string `json:"timeout,omitempty"` // how long to look for the open gateway
	Addr    string `json:"addr,omitempty"`    // knock here instead of browsing
}

// maxPairBrowse bounds pair join's --timeout, so that browsing plus the
// join itself fit in the CLI's wait for the daemon's answer.
const maxPairBrowse = 30 * time.Second

// defaultPairBrowse is how long pair join looks for the open gateway.
const defaultPairBrowse = 10 * time.Second

// registerPairAPI adds the pairing commands' endpoints.
func (d *Daemon) registerPairAPI(srv *admin.Server) {
	srv.HandleMutating("/v1/pair/open", d.handlePairOpen)
	srv.HandleMutating("/v1/pair/join", d.handlePairJoin)
}

func (d *Daemon) handlePairOpen(w http.ResponseWriter, r *http.Request) {
	var req pairOpenRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	var ttl time.Duration
	if req.TTL != "" {
		var err error
		if ttl, err = time.ParseDuration(req.TTL); err != nil || ttl <= 0 || ttl > maxPairTTL {
			admin.WriteError(w, http.StatusBadRequest, fmt.Errorf("ttl %q: a duration up to %v", req.TTL, maxPairTTL))
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	rep, err := d.cl.admin(ctx, adminRequest{Op: "pair", TTL: ttl})
	if err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	if rep.Code == "" {
		admin.WriteError(w, http.StatusConflict, errors.New("the master does not know pairing (an older version?): use tandem cluster invite"))
		return
	}
	admin.WriteJSON(w, http.StatusOK, pairOpenResponse{Code: rep.Code, Expires: rep.Expires.UTC().Format(time.RFC3339)})
}

func (d *Daemon) handlePairJoin(w http.ResponseWriter, r *http.Request) {
	var req pairJoinRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	mode, err := parseJoinMode(req.Mode)
	if err != nil {
		admin.WriteError(w, http.StatusBadRequest, err)
		return
	}
	within := defaultPairBrowse
	if req.Timeout != "" {
		var err error
		if within, err = time.ParseDuration(req.Timeout); err != nil || within <= 0 || within > maxPairBrowse {
			admin.WriteError(w, http.StatusBadRequest, fmt.Errorf("timeout %q: a duration up to %v", req.Timeout, maxPairBrowse))
			return
		}
	}
	if req.Addr != "" {
		if _, _, err := net.SplitHostPort(req.Addr); err != nil {
			admin.WriteError(w, http.StatusBadRequest, fmt.Errorf("addr %q: want HOST:PORT (the other gateway's peer port)", req.Addr))
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), within+55*time.Second)
	defer cancel()
	rep, err := d.cl.pairJoin(ctx, req.Code, mode, within, req.Addr)
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
			if ttl <= 0 || ttl > maxPairTTL {
				return config.UsageError{Err: fmt.Errorf("--ttl %v: a duration up to %v", ttl, maxPairTTL)}
			}
			var out pairOpenResponse
			if err := of.call("/v1/pair/open", pairOpenRequest{TTL: ttl.String()}, &out); err != nil {
				return err
			}
			fmt.Fprintln(c.OutOrStdout(), out.Code)
			fmt.Fprintf(c.ErrOrStderr(), "pairing open until %s, for one gateway: run `tandem pair join %s` on it\n", out.Expires, out.Code)
			return nil
		},
	}
	open.Flags().DurationVar(&ttl, "ttl", defaultPairTTL, "how long the code stays valid")
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
			if timeout <= 0 || timeout > maxPairBrowse {
				return config.UsageError{Err: fmt.Errorf("--timeout %v: a duration up to %v", timeout, maxPairBrowse)}
			}
			if _, err := parsePairCode(args[0]); err != nil {
				return config.UsageError{Err: err}
			}
			req := pairJoinRequest{Code: args[0], Timeout: timeout.String(), Addr: addr}
			if requeue {
				req.Mode = string(joinRequeue)
			} else if discard {
				req.Mode = string(joinDiscard)
			}
			var out admin.JoinResponse
			if err := jf.call("/v1/pair/join", req, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "paired: joined cluster %s (master %s; members %s)\n", out.Cluster, out.Master, strings.Join(out.Members, ", "))
			return nil
		},
	}
	join.Flags().BoolVar(&requeue, "requeue", false, "publish this gateway's records into the cluster")
	join.Flags().BoolVar(&discard, "discard", false, "drop this gateway's records")
	join.Flags().DurationVar(&timeout, "timeout", defaultPairBrowse, "how long to look on the LAN for the gateway with pairing open")
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
