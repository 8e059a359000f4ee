package mqtt

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Config configures a Broker.
type Config struct {
	// Listen is the TCP address of the MQTT listener ("127.0.0.1:1883").
	Listen string
	// TLS configures an MQTT-over-TLS listener; nil means none.
	TLS *TLSConfig
	// WebSocket configures an MQTT-over-WebSocket listener; nil means
	// none.
	WebSocket *WebSocketConfig
	// AllowAnonymous admits clients without credentials.
	AllowAnonymous bool
	// Users is the users file; nil means none (see Access).
	Users *Users
	// ACL is the ACL file; nil allows everything.
	ACL *ACL
	// Limits bounds clients, topics and connection rates.
	Limits Limits
	// MaxInflight is the receive maximum per client: how many QoS 1/2
	// publishes a client may have unacknowledged.
	MaxInflight int
	// MaxPacketSize bounds one packet, in bytes; 0 means 1 MiB... the MQTT
	// maximum of 256 MiB is too much for a gateway.
	MaxPacketSize uint32
	// TopicAliasMaximum is how many topic aliases an MQTT 5 client may
	// set; 0 means 100.
	TopicAliasMaximum uint16
	// MaxSubscriptions caps one client's subscriptions; over it a filter
	// gets SUBACK 0x97 (3.1.1: 0x80). 0 means 1,000.
	MaxSubscriptions int
	// MaxQueued is how many messages a connected session holds ready in
	// memory; past it the session reads the log instead. 0 means 1,000.
	MaxQueued int
	// Topics chooses each topic's ack mode; first match wins, default async.
	// SetTopics replaces them while the broker runs.
	Topics []TopicPolicy
	// SyncTimeout is how long a session take-over waits for the old
	// connection's acks.
	SyncTimeout time.Duration
	// Sessions persists sessions and retained messages; nil keeps them in
	// memory only.
	Sessions SessionStore
	// Logger receives the broker's messages; nil discards them.
	Logger *slog.Logger
	// Observer is told of each publish and ack, for metrics; nil means
	// none.
	Observer Observer
}

// Broker is the embedded MQTT server: mochi with tandem's ingest and
// persistence hooks.
type Broker struct {
	cfg     Config
	log     Log
	logger  *slog.Logger // rate-limited: info and warnings once a minute per message and client
	srv     *mochi.Server
	ingest  *ingest
	persist *persist
	tcp     *listener
	tls     *listener // nil without a TLS listener

	rawLogger *slog.Logger // cfg.Logger, for lines limited by refusals
	refusals  *logLimiter  // refused clients and packets: once a minute per reason and source

	// What a reload replaces; read on every connect, subscribe, publish
	// and delivery, so they are swapped whole, never changed in place.
	access  atomic.Pointer[Access]
	topics  atomic.Pointer[[]TopicPolicy]
	tlsConf atomic.Pointer[tls.Config]

	connRate     *connRate     // nil: no connect rate limit
	openConns    atomic.Int64  // sockets accepted and not yet closed, both listeners
	maxOpenConns int64         // sockets beyond it are closed at once
	bcryptSem    chan struct{} // bounds concurrent password checks
	refusedConns sync.Map      // net.Conn → true: refused and already logged by the guard

	shadowMu sync.Mutex // guards shadow, whose ID changes per delivery, and routes
	shadow   *mochi.Client
	// routes remembers, per topic delivered, whether it had subscribers,
	// so a record nobody subscribes to skips mochi's routing (its
	// subscriber scan allocates several maps per publish). A topic without
	// subscribers is only trusted while subsGen has not moved; one with
	// subscribers is simply routed.
	routes  map[string]route
	subsGen atomic.Uint64 // subscriptions made (OnSubscribed)
	closing atomic.Bool   // set by Stop: read loops held by back-pressure let go

	ackSig  chan struct{} // wakes the acker
	ackStop chan struct{}
	ackDone chan struct{}
}

// Listener ids, as mochi records them in cl.Net.Listener.
const (
	listenerID    = "tcp"
	tlsListenerID = "tls"
)

// New builds a broker that logs publishes through log.
func New(cfg Config, log Log) (*Broker, error) {
	if cfg.MaxInflight <= 0 {
		cfg.MaxInflight = 1024
	}
	if cfg.MaxInflight > 65535 {
		return nil, fmt.Errorf("mqtt: max_inflight %d exceeds 65535", cfg.MaxInflight)
	}
	if cfg.MaxPacketSize == 0 {
		cfg.MaxPacketSize = 1 << 20
	}
	if cfg.SyncTimeout == 0 {
		cfg.SyncTimeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cfg.Limits.setDefaults()
	caps := mochi.NewDefaultServerCapabilities()
	caps.ReceiveMaximum = uint16(cfg.MaxInflight)
	caps.MaximumPacketSize = cfg.MaxPacketSize
	caps.MaximumClientWritesPending = 8192
	caps.MaximumClients = int64(cfg.Limits.MaxClients)
	// One limiter for mochi's lines and ours: a client that misbehaves is
	// logged once a minute, not once per packet.
	lim := newLogLimiter(time.Minute)
	// mochi logs routine events (hooks added, listeners attached) at info;
	// only its warnings belong in a gateway's journal.
	mlog := slog.New(limitedHandler{mochiFilter{levelFloor{cfg.Logger.Handler(), slog.LevelWarn}}, lim}).With("component", "mochi")
	srv := mochi.New(&mochi.Options{Capabilities: caps, Logger: mlog})
	b := &Broker{cfg: cfg, log: log, srv: srv,
		logger:       slog.New(limitedHandler{cfg.Logger.Handler(), lim}),
		rawLogger:    cfg.Logger,
		refusals:     newLogLimiter(time.Minute),
		connRate:     newConnRate(cfg.Limits.ConnectRate, cfg.Limits.ConnectBurst),
		maxOpenConns: int64(2*cfg.Limits.MaxClients + 16),
		bcryptSem:    make(chan struct{}, max(1, runtime.GOMAXPROCS(0)/2)),
		ackSig:       make(chan struct{}, 1), ackStop: make(chan struct{}), ackDone: make(chan struct{})}
	b.access.Store(&Access{AllowAnonymous: cfg.AllowAnonymous, Users: cfg.Users, ACL: cfg.ACL})
	b.SetTopics(cfg.Topics)
	go b.acker()
	b.persist = &persist{store: cfg.Sessions, b: b}
	b.ingest = &ingest{b: b, clients: map[string]*clientState{}, wills: map[string]*time.Timer{}}
	// First: its OnConnect and OnPacketRead refuse before anything else
	// sees the client or the packet.
	if err := srv.AddHook(&guard{b: b}, nil); err != nil {
		return nil, err
	}
	if err := srv.AddHook(b.persist, nil); err != nil {
		return nil, err
	}
	// Last: its OnPacketRead takes over the PUBLISHes the guard let in.
	if err := srv.AddHook(b.ingest, nil); err != nil {
		return nil, err
	}
	b.shadow = srv.NewClient(nil, listenerID, "tandem-deliver", true)
	b.shadow.Properties.ProtocolVersion = 5
	b.tcp = &listener{id: listenerID, addr: cfg.Listen, b: b}
	if err := srv.AddListener(b.tcp); err != nil {
		return nil, fmt.Errorf("mqtt: listen %s: %w", cfg.Listen, err)
	}
	if cfg.TLS != nil {
		if err := b.addTLS(); err != nil {
			b.tcp.Close(func(string) {})
			return nil, err
		}
	}
	return b, nil
}

// addTLS loads the TLS configuration and adds the TLS listener.
func (b *Broker) addTLS() error {
	conf, err := loadTLS(b.cfg.TLS)
	if err != nil {
		return err
	}
	b.tlsConf.Store(conf)
	// Every handshake takes the configuration of the moment, so ReloadTLS
	// can change certificates under a running listener.
	outer := &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return b.tlsConf.Load(), nil }}
	b.tls = &listener{id: tlsListenerID, addr: b.cfg.TLS.Listen, tls: outer, b: b}
	if err := b.srv.AddListener(b.tls); err != nil {
		b.tls = nil
		return fmt.Errorf("mqtt: tls listen %s: %w", b.cfg.TLS.Listen, err)
	}
	return nil
}

// SetAccess replaces the users, ACLs and anonymous rule. Connected clients
// stay connected; their next subscribe, publish or delivery is checked
// against the new rules.
func (b *Broker) SetAccess(a Access) { b.access.Store(&a) }

// SetTopics replaces the topic ack rules; publishes taken after it returns
// are acked by the new rules.
func (b *Broker) SetTopics(p []TopicPolicy) {
	p = slices.Clone(p)
	b.topics.Store(&p)
}

// topicPolicies returns the topic ack rules in force.
func (b *Broker) topicPolicies() []TopicPolicy { return *b.topics.Load() }

// ReloadTLS reads the TLS listener's certificate, key and client CAs
// again; new handshakes use them, established connections keep theirs. On
// error the previous ones stay. Without a TLS listener it does nothing.
func (b *Broker) ReloadTLS() error {
	if b.tls == nil {
		return nil
	}
	conf, err := loadTLS(b.cfg.TLS)
	if err != nil {
		return err
	}
	b.tlsConf.Store(conf)
	return nil
}

// TLSAddr returns the TLS listener's address, or "" without one.
func (b *Broker) TLSAddr() string {
	if b.tls == nil {
		return ""
	}
	return b.tls.Address()
}

// Start loads the persisted sessions and retained messages and starts
// serving.
func (b *Broker) Start() error {
	if err := b.srv.Serve(); err != nil {
		return fmt.Errorf("mqtt: %w", err)
	}
	b.logger.Info("mqtt listening", "addr", b.Addr())
	if b.tls != nil {
		b.logger.Info("mqtt tls listening", "addr", b.TLSAddr(), "client_certs", b.cfg.TLS.RequireClientCert)
	}
	return nil
}

// Addr returns the listener's address (useful with port 0).
func (b *Broker) Addr() string { return b.tcp.Address() }

// Stop closes the listener and every client; will messages of the clients it
// disconnects are proposed as records.
func (b *Broker) Stop() error {
	b.closing.Store(true)
	b.ingest.wakeAll()
	err := b.srv.Close()
	b.ingest.stopWills()
	select {
	case <-b.ackStop:
	default:
		close(b.ackStop)
	}
	<-b.ackDone
	return err
}

// goFunc runs f on a goroutine of its own. Ack writers are short-lived and
// end with their client's connection, so Stop does not wait for them.
func (b *Broker) goFunc(f func()) { go f() }

// Applied does nothing: mochi's sessions hold copies, not cursors.
func (b *Broker) Applied(uint64) {}

// Rewind does nothing: mochi's sessions hold copies, not cursors.
func (b *Broker) Rewind(uint64, uint64) {}

// Deliver hands a committed record to the local subscribers and the retained
// store, with every MQTT 5 property kept. It is called in log order from one
// goroutine, which skips with Unrouted the records nobody would receive.
func (b *Broker) Deliver(_ uint64, m *Message) error {
	pk, live := m.packet(time.Now())
	if !live {
		return nil // its message expiry ran out before it was delivered
	}
	b.shadowMu.Lock()
	defer b.shadowMu.Unlock()
	// The publisher's id as origin keeps NoLocal subscriptions working.
	b.shadow.ID = m.ClientID
	err := b.srv.InjectPacket(b.shadow, pk)
	var code packets.Code
	switch {
	case err == nil, errors.Is(err, packets.ErrRejectPacket):
		return nil
	case errors.As(err, &code):
		// A record mochi refuses to route (a topic it deems invalid) is
		// skipped, the same way on every member, rather than stopping the
		// log: it stays in the log for inspect.
		b.logger.Warn("committed record not deliverable", "topic", m.Topic, "client", m.ClientID, "error", err)
		return nil
	}
	return fmt.Errorf("mqtt: deliver %s: %w", m.Topic, err)
}

// route is what Deliver knows of a topic's subscribers.
type route struct {
	none bool   // no subscriber matched
	gen  uint64 // subsGen when that was found
}

// maxRoutes bounds the topics remembered; past it they are forgotten.
const maxRoutes = 4096

// Unrouted reports whether no local subscriber matches topic, so that a
// record on it without retain needs neither a Message nor Deliver. The topic
// is still in its record's bytes: a topic seen before costs no allocation.
func (b *Broker) Unrouted(topic []byte) bool {
	b.shadowMu.Lock()
	defer b.shadowMu.Unlock()
	return b.unroutedLocked(topic)
}

// unroutedLocked is Unrouted from the cache when it can. Called with
// shadowMu held.
func (b *Broker) unroutedLocked(topic []byte) bool {
	gen := b.subsGen.Load() // before the scan: a subscription made meanwhile moves it
	if r, ok := b.routes[string(topic)]; ok && (!r.none || r.gen == gen) {
		return r.none
	}
	t := string(topic)
	subs := b.srv.Topics.Subscribers(t)
	none := len(subs.Subscriptions) == 0 && len(subs.Shared) == 0 && len(subs.InlineSubscriptions) == 0
	if b.routes == nil || len(b.routes) >= maxRoutes {
		b.routes = make(map[string]route)
	}
	b.routes[t] = route{none: none, gen: gen}
	return none
}

// subscribed is told of every subscription made: topics remembered
// without subscribers are scanned again.
func (b *Broker) subscribed() { b.subsGen.Add(1) }

// ReleaseAcks has the acks the Log resolved since the last call written,
// by the broker's acker goroutine: the acks a batch resolves for one client
// leave in one write, and the Log's goroutine goes straight back to its next
// commit. It never blocks.
func (b *Broker) ReleaseAcks() {
	select {
	case b.ackSig <- struct{}{}:
	default: // the acker is already due to run
	}
}

// acker writes released acks until Stop.
func (b *Broker) acker() {
	defer close(b.ackDone)
	for {
		select {
		case <-b.ackSig:
			b.ingest.releaseReady()
		case <-b.ackStop:
			b.ingest.releaseReady()
			return
		}
	}
}

// Clients returns the number of connected clients.
func (b *Broker) Clients() int64 { return atomic.LoadInt64(&b.srv.Info.ClientsConnected) }

// Inflight returns the QoS 1/2 messages in flight, both directions.
func (b *Broker) Inflight() int64 { return atomic.LoadInt64(&b.srv.Info.Inflight) }

// levelFloor drops records below min before they reach h.
type levelFloor struct {
	slog.Handler
	min slog.Level
}

func (l levelFloor) Enabled(ctx context.Context, lv slog.Level) bool {
	return lv >= l.min && l.Handler.Enabled(ctx, lv)
}

func (l levelFloor) WithAttrs(a []slog.Attr) slog.Handler {
	return levelFloor{l.Handler.WithAttrs(a), l.min}
}

func (l levelFloor) WithGroup(g string) slog.Handler {
	return levelFloor{l.Handler.WithGroup(g), l.min}
}

// mochiFilter drops mochi's warning about keep-alives of 5 s or less: it
// comes with every such CONNECT, keep-alive 0 included, and keep-alive
// bounds are the gateway's business (Limits).
type mochiFilter struct{ slog.Handler }

func (f mochiFilter) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == mochi.ErrMinimumKeepalive.Error() {
		return nil
	}
	return f.Handler.Handle(ctx, r)
}

func (f mochiFilter) WithAttrs(a []slog.Attr) slog.Handler {
	return mochiFilter{f.Handler.WithAttrs(a)}
}

func (f mochiFilter) WithGroup(g string) slog.Handler { return mochiFilter{f.Handler.WithGroup(g)} }
