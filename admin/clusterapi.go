package admin

// The cluster API: the endpoints `tandem cluster ...`, `tandem pair ...`
// and `tandem promote` call on the running daemon, behind the guard for
// endpoints that change the gateway. The requests and answers are in
// api.go; the work is the control plane's, through Cluster.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/replication"
)

// Cluster is what the cluster endpoints ask of the control plane. The
// daemon implements it over cluster.Gateway. An error that wraps
// ErrNoMaster answers 503, a config.UsageError 400, any other 409.
type Cluster interface {
	// Invite asks the master for a join token valid for ttl (0: the
	// default).
	Invite(ctx context.Context, ttl time.Duration) (token string, expires time.Time, err error)
	// Join makes this gateway a member of the cluster that issued token;
	// mode is "", "requeue" or "discard".
	Join(ctx context.Context, token, mode string) (JoinResponse, error)
	// Remove asks the master to remove member node (a name or an id).
	Remove(ctx context.Context, node string, force bool) (removed string, err error)
	// Promote makes this slave the master and names the master it
	// replaced and the cluster's generation now.
	Promote(ctx context.Context, force bool) (PromoteResponse, error)
	// OpenPairing asks the master to open pairing for ttl (0: the
	// default); an empty code means a master that does not know pairing.
	OpenPairing(ctx context.Context, ttl time.Duration) (code string, expires time.Time, err error)
	// PairJoin makes this gateway a member of the cluster that opened
	// pairing with code, looked for for up to within, or knocked at addr.
	PairJoin(ctx context.Context, code, mode string, within time.Duration, addr string) (JoinResponse, error)
}

// ErrNoMaster is what Cluster's errors wrap when no master is in sight
// now: the request may succeed later (503).
var ErrNoMaster = errors.New("no master")

// MaxPairTTL bounds pair open's ttl: a code is meant for someone on site
// now.
const MaxPairTTL = time.Hour

// Join modes: what a joining gateway does with the records it holds.
const (
	JoinRequeue = "requeue" // publish them into the cluster
	JoinDiscard = "discard" // drop them
)

// HandleCluster registers the cluster commands' endpoints, behind the guard
// for endpoints that change the gateway.
func (s *Server) HandleCluster(c Cluster) {
	h := clusterAPI{c}
	s.HandleMutating("/v1/cluster/invite", h.handleInvite)
	s.HandleMutating("/v1/cluster/join", h.handleJoin)
	s.HandleMutating("/v1/cluster/remove", h.handleRemove)
	s.HandleMutating("/v1/cluster/promote", h.handlePromote)
	s.HandleMutating("/v1/pair/open", h.handlePairOpen)
	s.HandleMutating("/v1/pair/join", h.handlePairJoin)
}

// clusterAPI serves the endpoints of HandleCluster.
type clusterAPI struct{ c Cluster }

// statusOf maps an error to the status of its answer.
func statusOf(err error) int {
	var ue config.UsageError
	switch {
	case errors.As(err, &ue):
		return http.StatusBadRequest
	case errors.Is(err, ErrNoMaster):
		return http.StatusServiceUnavailable
	}
	return http.StatusConflict
}

func (h clusterAPI) handleInvite(w http.ResponseWriter, r *http.Request) {
	var req InviteRequest
	if err := DecodeBody(r, &req); err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	var ttl time.Duration
	if req.TTL != "" {
		var err error
		if ttl, err = time.ParseDuration(req.TTL); err != nil || ttl <= 0 || ttl > 7*24*time.Hour {
			WriteError(w, http.StatusBadRequest, fmt.Errorf("ttl %q: a duration up to 168h", req.TTL))
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	token, expires, err := h.c.Invite(ctx, ttl)
	if err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	WriteJSON(w, http.StatusOK, InviteResponse{Token: token, Expires: expires.UTC().Format(time.RFC3339)})
}

func (h clusterAPI) handleJoin(w http.ResponseWriter, r *http.Request) {
	var req JoinRequest
	if !decodeJoin(w, r, &req, &req.Mode) {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	j, err := h.c.Join(ctx, req.Token, req.Mode)
	answer(w, j, err)
}

// decodeJoin reads a join request's body into req, then checks its mode
// (read from req after the decoding); false when it has answered with the
// error already.
func decodeJoin(w http.ResponseWriter, r *http.Request, req any, mode *string) bool {
	if err := DecodeBody(r, req); err != nil {
		WriteError(w, statusOf(err), err)
		return false
	}
	switch *mode {
	case "", JoinRequeue, JoinDiscard:
		return true
	}
	WriteError(w, http.StatusBadRequest, fmt.Errorf("mode %q: requeue or discard", *mode))
	return false
}

// answer writes v (200), or err with the status statusOf gives it.
func answer(w http.ResponseWriter, v any, err error) {
	if err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	WriteJSON(w, http.StatusOK, v)
}

func (h clusterAPI) handleRemove(w http.ResponseWriter, r *http.Request) {
	var req RemoveRequest
	if err := DecodeBody(r, &req); err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	if req.Node == "" {
		WriteError(w, http.StatusBadRequest, errors.New("which node? give its name or id"))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	removed, err := h.c.Remove(ctx, req.Node, req.Force)
	if err != nil {
		if errors.Is(err, replication.ErrLastVoter) {
			err = errors.New("cannot remove the last voter of the cluster")
		}
		WriteError(w, statusOf(err), err)
		return
	}
	WriteJSON(w, http.StatusOK, RemoveResponse{Removed: removed})
}

func (h clusterAPI) handlePairOpen(w http.ResponseWriter, r *http.Request) {
	var req PairOpenRequest
	if err := DecodeBody(r, &req); err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	var ttl time.Duration
	if req.TTL != "" {
		var err error
		if ttl, err = time.ParseDuration(req.TTL); err != nil || ttl <= 0 || ttl > MaxPairTTL {
			WriteError(w, http.StatusBadRequest, fmt.Errorf("ttl %q: a duration up to %v", req.TTL, MaxPairTTL))
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	code, expires, err := h.c.OpenPairing(ctx, ttl)
	if err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	if code == "" {
		WriteError(w, http.StatusConflict, errors.New("the master does not know pairing (an older version?): use tandem cluster invite"))
		return
	}
	WriteJSON(w, http.StatusOK, PairOpenResponse{Code: code, Expires: expires.UTC().Format(time.RFC3339)})
}

func (h clusterAPI) handlePairJoin(w http.ResponseWriter, r *http.Request) {
	var req PairJoinRequest
	if !decodeJoin(w, r, &req, &req.Mode) {
		return
	}
	within := DefaultPairBrowse
	if req.Timeout != "" {
		var err error
		if within, err = time.ParseDuration(req.Timeout); err != nil || within <= 0 || within > MaxPairBrowse {
			WriteError(w, http.StatusBadRequest, fmt.Errorf("timeout %q: a duration up to %v", req.Timeout, MaxPairBrowse))
			return
		}
	}
	if req.Addr != "" {
		if _, _, err := net.SplitHostPort(req.Addr); err != nil {
			WriteError(w, http.StatusBadRequest, fmt.Errorf("addr %q: want HOST:PORT (the other gateway's peer port)", req.Addr))
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), within+55*time.Second)
	defer cancel()
	j, err := h.c.PairJoin(ctx, req.Code, req.Mode, within, req.Addr)
	answer(w, j, err)
}

func (h clusterAPI) handlePromote(w http.ResponseWriter, r *http.Request) {
	var req PromoteRequest
	if err := DecodeBody(r, &req); err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	out, err := h.c.Promote(ctx, req.Force)
	answer(w, out, err)
}
