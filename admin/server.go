package admin

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
)

// Gateway is what the admin server reads of the running gateway. The
// daemon implements it; admin knows nothing of storage, replication or the
// broker beyond it.
type Gateway interface {
	// Status assembles the status JSON. It fails (wrapping
	// replication.ErrStopped) while the node is stopped for good.
	Status(ctx context.Context) (*Status, error)
	// Err is why the gateway cannot serve, nil while it can: /healthz.
	Err() error
	// Live is the configuration in force: the one started with, then
	// each reload's.
	Live() *config.Config
	// Retained is the number of retained messages held.
	Retained() int64
	// LeaderChanges counts the master changes replication has seen,
	// which the status JSON does not carry.
	LeaderChanges(ctx context.Context) (uint64, error)
	// Promotions and Depositions count this gateway's promotions to
	// master and the times it found itself replaced as master.
	Promotions() uint64
	Depositions() uint64
}

// Server is the HTTP listener of http.listen: the /v1 API, /healthz,
// /metrics and the status page, behind the guard of guard.go and with
// bounds on time, header size and connections (connlimit.go), so a slow or
// flooding client cannot hold the daemon's memory, nor every connection
// `tandem status` needs.
//
// NewServer registers the read-only endpoints; the daemon adds the
// mutating ones with HandleMutating before Start.
type Server struct {
	gw    Gateway
	log   *slog.Logger
	fv    *FieldView
	guard *apiGuard
	mux   *http.ServeMux
	// mutating lists the endpoints registered behind the guard's mutating
	// check, so that a test can try every one of them.
	mutating []string

	// The connection budget: http.max_conns, max_conns_per_address and
	// idle_timeout, defaults filled in.
	maxConns, maxConnsPerAddr int
	idleTimeout               time.Duration
	// isLocal judges a source loopback; nil means netip.Addr.IsLoopback.
	// Tests set it to make some loopback addresses strangers.
	isLocal      func(netip.Addr) bool
	refusalLines *mqtt.LogLimiter

	srv *http.Server
	ln  net.Listener
	lim *connLimiter
	wg  sync.WaitGroup // the Serve goroutine
}

// NewServer finds or makes the API token (see guard.go) and registers the
// read-only endpoints. fv is the gateway's field view, which must exist
// before the server does: the storage and the broker report to it from the
// start.
func NewServer(cfg *config.Config, log *slog.Logger, gw Gateway, fv *FieldView) (*Server, error) {
	g, err := newAPIGuard(cfg, log)
	if err != nil {
		return nil, err
	}
	s := &Server{gw: gw, log: log, fv: fv, guard: g, mux: http.NewServeMux(),
		maxConns: cmp.Or(cfg.HTTP.MaxConns, defaultHTTPMaxConns), maxConnsPerAddr: cmp.Or(cfg.HTTP.MaxConnsPerAddress, defaultHTTPMaxConnsPerAddr),
		idleTimeout: cmp.Or(time.Duration(cfg.HTTP.IdleTimeout), defaultHTTPIdleTimeout), refusalLines: mqtt.NewLogLimiter(time.Minute)}
	s.mux.HandleFunc("GET /healthz", s.handleHealthz)
	s.mux.HandleFunc("GET /v1/status", s.handleStatus)
	s.mux.Handle("GET /metrics", fv.metricsHandler())
	s.mux.HandleFunc("GET /{$}", fv.servePage)
	return s, nil
}

// HandleMutating registers h for POST path behind the guard's checks for
// endpoints that change the gateway (Host, Origin, JSON body, API token).
func (s *Server) HandleMutating(path string, h http.HandlerFunc) {
	s.mux.HandleFunc("POST "+path, s.guard.mutating(h))
	s.mutating = append(s.mutating, path)
}

// MutatingPaths lists the paths registered with HandleMutating.
func (s *Server) MutatingPaths() []string { return s.mutating }

// Start listens on addr, serves, and starts the field view's sampler. A
// listen error is returned as it is, for the caller to explain.
func (s *Server) Start(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	s.ln = ln
	s.lim = newConnLimiter(ln, s.maxConns, s.maxConnsPerAddr, s.refused)
	if s.isLocal != nil {
		s.lim.isLocal = s.isLocal
	}
	s.srv = &http.Server{
		Handler:           refuseOver(s.guard.readOnly(s.mux), s.idleTimeout),
		ReadHeaderTimeout: min(httpReadHeaderTimeout, s.idleTimeout),
		ReadTimeout:       httpReadTimeout,
		WriteTimeout:      httpWriteTimeout,
		IdleTimeout:       s.idleTimeout,
		MaxHeaderBytes:    httpMaxHeaderBytes,
		ConnContext:       connContext,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	s.fv.start()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := s.srv.Serve(s.lim); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("http server stopped", "error", err)
		}
	}()
	return nil
}

// Addr is the listener's address, "" before Start.
func (s *Server) Addr() string {
	if s.ln == nil {
		return ""
	}
	return s.ln.Addr().String()
}

// Stop shuts the listener down, giving requests in flight 2 s, and waits
// for the Serve goroutine.
func (s *Server) Stop() {
	if s.srv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	_ = s.srv.Shutdown(ctx)
	cancel()
	s.wg.Wait()
}

// refused counts a connection the budget refused and logs it, once a
// minute per source address.
func (s *Server) refused(reason, source string, open int) {
	s.fv.httpRefused(reason)
	if ok, _ := s.refusalLines.Allow(source, time.Now()); ok {
		s.log.Warn("http connection refused: "+reason, "remote", source, "open", open,
			"max_conns", s.maxConns, "max_conns_per_address", s.maxConnsPerAddr)
	}
}

func (s *Server) handleHealthz(w http.ResponseWriter, r *http.Request) {
	if err := s.gw.Err(); err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintln(w, "ok")
}

func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	st, err := s.gw.Status(ctx)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(st)
}
