package mqtt

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Config configures a Broker.
type Config struct {
	// Listen is the TCP address of the MQTT listener ("127.0.0.1:1883").
	Listen string
	// AllowAnonymous admits clients without credentials.
	AllowAnonymous bool
	// MaxInflight is the receive maximum per client: how many QoS 1/2
	// publishes a client may have unacknowledged.
	MaxInflight int
	// MaxPacketSize bounds one packet, in bytes; 0 means 1 MiB... the MQTT
	// maximum of 256 MiB is too much for a gateway.
	MaxPacketSize uint32
	// Topics chooses each topic's ack mode; first match wins, default async.
	Topics []TopicPolicy
	// SyncTimeout is how long a session take-over waits for the old
	// connection's acks.
	SyncTimeout time.Duration
	// Sessions persists sessions and retained messages; nil keeps them in
	// memory only.
	Sessions SessionStore
	// Logger receives the broker's messages; nil discards them.
	Logger *slog.Logger
}

// Broker is the embedded MQTT server: mochi with tandem's ingest and
// persistence hooks.
type Broker struct {
	cfg     Config
	log     Log
	logger  *slog.Logger
	srv     *mochi.Server
	ingest  *ingest
	persist *persist
	tcp     *listeners.TCP

	shadowMu sync.Mutex // guards shadow, whose ID changes per delivery
	shadow   *mochi.Client
	closing  atomic.Bool // set by Stop: read loops held by back-pressure let go

	ackSig  chan struct{} // wakes the acker
	ackStop chan struct{}
	ackDone chan struct{}
}

const listenerID = "tcp"

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
	caps := mochi.NewDefaultServerCapabilities()
	caps.ReceiveMaximum = uint16(cfg.MaxInflight)
	caps.MaximumPacketSize = cfg.MaxPacketSize
	caps.MaximumClientWritesPending = 8192
	// mochi logs routine events (hooks added, listeners attached) at info;
	// only its warnings belong in a gateway's journal.
	mlog := slog.New(levelFloor{cfg.Logger.Handler(), slog.LevelWarn}).With("component", "mochi")
	srv := mochi.New(&mochi.Options{Capabilities: caps, Logger: mlog})
	b := &Broker{cfg: cfg, log: log, logger: cfg.Logger, srv: srv,
		ackSig: make(chan struct{}, 1), ackStop: make(chan struct{}), ackDone: make(chan struct{})}
	go b.acker()
	b.persist = &persist{store: cfg.Sessions, b: b}
	b.ingest = &ingest{b: b, clients: map[string]*clientState{}, wills: map[string]*time.Timer{}}
	if err := srv.AddHook(b.persist, nil); err != nil {
		return nil, err
	}
	// Last: Hooks.OnPublish stops at the ingest hook's ErrRejectPacket.
	if err := srv.AddHook(b.ingest, nil); err != nil {
		return nil, err
	}
	b.shadow = srv.NewClient(nil, listenerID, "tandem-deliver", true)
	b.shadow.Properties.ProtocolVersion = 5
	b.tcp = listeners.NewTCP(listeners.Config{ID: listenerID, Address: cfg.Listen})
	if err := srv.AddListener(b.tcp); err != nil {
		return nil, fmt.Errorf("mqtt: listen %s: %w", cfg.Listen, err)
	}
	return b, nil
}

// Start loads the persisted sessions and retained messages and starts
// serving.
func (b *Broker) Start() error {
	if err := b.srv.Serve(); err != nil {
		return fmt.Errorf("mqtt: %w", err)
	}
	b.logger.Info("mqtt listening", "addr", b.Addr())
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

// Deliver hands a committed record to the local subscribers and the retained
// store, with every MQTT 5 property kept. It is called in log order from one
// goroutine.
func (b *Broker) Deliver(m *Message) error {
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

// anonymousOK reports whether listener admits clients without credentials.
// The daemon's config decides (loopback default, or allow_anonymous).
func (b *Broker) anonymousOK(string) bool { return b.cfg.AllowAnonymous }

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
