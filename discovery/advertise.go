package discovery

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"strings"
	"sync"
)

// Config says what to advertise and where.
type Config struct {
	// Interface is the LAN interface to advertise on (e.g. "eth0"); empty
	// lets the OS (or avahi) choose: every interface with multicast.
	Interface string
	// Instance is the DNS-SD service instance name, usually the node name.
	// Empty means Info().Name, or "tandem-" and the short id.
	Instance string
	// Info returns this gateway's live state. It is called on every answer
	// (hashicorp/mdns path) and on Changed (avahi path), so it must be
	// cheap and safe to call from other goroutines. Required.
	Info func() Info
	// Logger gets debug lines about the mDNS traffic and warnings; nil
	// discards them.
	Logger *slog.Logger
}

// Backends an Advertiser can run on (Advertiser.Backend).
const (
	BackendAvahi = "avahi" // avahi-daemon over D-Bus
	BackendMDNS  = "mdns"  // github.com/hashicorp/mdns on port 5353
)

// Advertiser answers for this gateway on the LAN until Close.
type Advertiser struct {
	backend string
	log     *slog.Logger
	avahi   *avahiGroup  // avahi path
	server  mdnsShutdown // hashicorp/mdns path

	mu     sync.Mutex // guards closed
	closed bool
}

type mdnsShutdown interface{ Shutdown() error }

// Advertise starts advertising _tandem._tcp (and _mqtt._tcp when
// Info().MQTTPort is set). Where avahi-daemon runs it registers the
// services with avahi; elsewhere it answers mDNS queries itself with
// hashicorp/mdns.
func Advertise(cfg Config) (*Advertiser, error) {
	if cfg.Info == nil {
		return nil, errors.New("discovery: Config.Info is required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	var ifi *net.Interface
	if cfg.Interface != "" {
		var err error
		if ifi, err = net.InterfaceByName(cfg.Interface); err != nil {
			return nil, fmt.Errorf("discovery: interface %q: %w", cfg.Interface, err)
		}
	}
	a := &Advertiser{log: cfg.Logger}
	if conn := avahiConn(context.Background()); conn != nil {
		g, err := newAvahiGroup(conn, cfg, ifi)
		if err != nil {
			conn.Close()
			return nil, err
		}
		a.backend, a.avahi = BackendAvahi, g
		cfg.Logger.Info("mdns: advertising through avahi-daemon", "instance", g.instance())
		return a, nil
	}
	s, err := newMDNSServer(cfg, ifi)
	if err != nil {
		return nil, err
	}
	a.backend, a.server = BackendMDNS, s
	cfg.Logger.Info("mdns: advertising on port 5353 (no avahi-daemon)", "interface", cfg.Interface)
	return a, nil
}

// Backend names the path in use: BackendAvahi or BackendMDNS.
func (a *Advertiser) Backend() string { return a.backend }

// Changed tells the advertiser that Info's values changed (role, term,
// generation, pairing, ports). Avahi re-announces them at once; the
// hashicorp/mdns path needs nothing (it answers from Info every time) and
// cannot announce: peers see the change on their next query.
func (a *Advertiser) Changed() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || a.avahi == nil {
		return
	}
	if err := a.avahi.update(); err != nil {
		a.log.Warn("mdns: avahi update failed", "err", err)
	}
}

// Close stops advertising. On the avahi path the services are withdrawn
// with goodbye packets; hashicorp/mdns just stops answering.
func (a *Advertiser) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	a.closed = true
	if a.avahi != nil {
		return a.avahi.close()
	}
	return a.server.Shutdown()
}

// instanceName is the service instance name for cfg and info.
func instanceName(cfg Config, info Info) string {
	switch {
	case cfg.Instance != "":
		return cfg.Instance
	case info.Name != "":
		return info.Name
	}
	id := info.ID
	if len(id) > 8 {
		id = id[:8]
	}
	return "tandem-" + id
}

// stdLogger adapts the standard logger hashicorp/mdns writes to slog at
// debug level: it logs every packet it cannot parse, and the LAN is noisy.
func stdLogger(l *slog.Logger) *log.Logger {
	return log.New(slogWriter{l}, "", 0)
}

type slogWriter struct{ l *slog.Logger }

func (w slogWriter) Write(p []byte) (int, error) {
	w.l.Debug(strings.TrimSpace(string(p)))
	return len(p), nil
}
