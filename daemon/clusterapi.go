package daemon

// The cluster API: the endpoints `tandem cluster ...`, `tandem pair ...`
// and `tandem promote` call on the running daemon, registered behind the
// admin server's guard for endpoints that change the gateway. The requests
// and answers are admin's (admin/api.go); the work is the cluster's.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/cluster"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/replication"
)

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
	case errors.Is(err, cluster.ErrNoMaster):
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
	token, err := d.gw.Invite(ctx, ttl)
	if err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	tok, _, err := cluster.ParseToken(token, time.Now())
	if err != nil {
		admin.WriteError(w, http.StatusInternalServerError, err)
		return
	}
	admin.WriteJSON(w, http.StatusOK, admin.InviteResponse{Token: token, Expires: time.Unix(tok.Expires, 0).UTC().Format(time.RFC3339)})
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
	j, err := d.gw.Join(ctx, req.Token, mode)
	if err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	admin.WriteJSON(w, http.StatusOK, admin.JoinResponse{Cluster: j.Cluster, Master: j.Master, Members: j.Members})
}

// parseJoinMode reads the mode of a join request.
func parseJoinMode(s string) (cluster.JoinMode, error) {
	switch m := cluster.JoinMode(s); m {
	case cluster.JoinFresh, cluster.JoinRequeue, cluster.JoinDiscard:
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
	removed, err := d.gw.Remove(ctx, req.Node, req.Force)
	if err != nil {
		if errors.Is(err, replication.ErrLastVoter) {
			err = errors.New("cannot remove the last voter of the cluster")
		}
		admin.WriteError(w, statusOf(err), err)
		return
	}
	admin.WriteJSON(w, http.StatusOK, admin.RemoveResponse{Removed: removed})
}

// registerPairAPI adds the pairing commands' endpoints.
func (d *Daemon) registerPairAPI(srv *admin.Server) {
	srv.HandleMutating("/v1/pair/open", d.handlePairOpen)
	srv.HandleMutating("/v1/pair/join", d.handlePairJoin)
}

func (d *Daemon) handlePairOpen(w http.ResponseWriter, r *http.Request) {
	var req admin.PairOpenRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	var ttl time.Duration
	if req.TTL != "" {
		var err error
		if ttl, err = time.ParseDuration(req.TTL); err != nil || ttl <= 0 || ttl > cluster.MaxPairTTL {
			admin.WriteError(w, http.StatusBadRequest, fmt.Errorf("ttl %q: a duration up to %v", req.TTL, cluster.MaxPairTTL))
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	code, expires, err := d.gw.OpenPairing(ctx, ttl)
	if err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	if code == "" {
		admin.WriteError(w, http.StatusConflict, errors.New("the master does not know pairing (an older version?): use tandem cluster invite"))
		return
	}
	admin.WriteJSON(w, http.StatusOK, admin.PairOpenResponse{Code: code, Expires: expires.UTC().Format(time.RFC3339)})
}

func (d *Daemon) handlePairJoin(w http.ResponseWriter, r *http.Request) {
	var req admin.PairJoinRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	mode, err := parseJoinMode(req.Mode)
	if err != nil {
		admin.WriteError(w, http.StatusBadRequest, err)
		return
	}
	within := admin.DefaultPairBrowse
	if req.Timeout != "" {
		var err error
		if within, err = time.ParseDuration(req.Timeout); err != nil || within <= 0 || within > admin.MaxPairBrowse {
			admin.WriteError(w, http.StatusBadRequest, fmt.Errorf("timeout %q: a duration up to %v", req.Timeout, admin.MaxPairBrowse))
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
	j, err := d.gw.PairJoin(ctx, req.Code, mode, within, req.Addr)
	if err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	admin.WriteJSON(w, http.StatusOK, admin.JoinResponse{Cluster: j.Cluster, Master: j.Master, Members: j.Members})
}

func (d *Daemon) handlePromote(w http.ResponseWriter, r *http.Request) {
	var req admin.PromoteRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	deposed, gen, err := d.gw.Promote(ctx, req.Force)
	if err != nil {
		admin.WriteError(w, statusOf(err), err)
		return
	}
	admin.WriteJSON(w, 200, admin.PromoteResponse{Deposed: deposed, Generation: gen})
}
