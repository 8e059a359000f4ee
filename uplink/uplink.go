package uplink

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/autopaho"

	"github.com/tandem-edge/tandem/internal/clock"
)

// How often the position is handed to the PositionSink: after SaveAcks
// acks or SaveEvery, whichever comes first. What the cloud sees twice
// after a failover is what was acked since the last save.
const (
	SaveEvery = 100 * time.Millisecond
	SaveAcks  = 1000
)

// serverPrefix starts the server's topics: no device writes one, and the
// gateway's own records are notified under one (they never leave the
// cluster), so no rule forwards them, # included.
const serverPrefix = "$"

// oldestScanLimit bounds the records Status looks at to find the oldest
// undelivered one.
const oldestScanLimit = 10000

// Deps are what an uplink is plugged into.
type Deps struct {
	Log       Log
	Positions PositionSink
	Filters   Filters // Match is required
	// Local takes downlink messages; required when the config has a
	// downlink.
	Local  LocalPublisher
	Logger *slog.Logger // nil: slog.Default()
}

// Uplink forwards committed records to one cloud broker and brings its
// downlink in. See doc.go.
type Uplink struct {
	cfg      Config
	match    func(filter, topic string) bool
	log      Log
	sink     PositionSink
	local    LocalPublisher
	logger   *slog.Logger
	password []byte
	tlsConf  *tls.Config // nil for tcp://
	backoff  autopaho.Backoff

	saveMu sync.Mutex // serialises Save calls, so the sink sees positions in order

	mu        sync.Mutex // guards everything below
	running   bool
	stopc     chan struct{}
	wg        sync.WaitGroup
	wake      chan struct{} // capacity 1: something to do (records, resume)
	paused    bool
	cutConn   func() // ends the current connection; nil without one
	committed uint64 // the last index Notify or Start named
	counted   uint64 // records up to here are counted in the backlog
	caughtUp  bool   // counted follows Notify directly
	pos       uint64 // every record up to here is dealt with (acked, dropped, not ours)
	readUpTo  uint64 // every record of ours up to here has been sent, or dropped
	inflight  int    // sent and not acked
	highSent  uint64 // the highest index ever sent in this run: resends are below
	backlogN  int64
	backlogB  int64
	saved     uint64 // the last position handed to the sink
	savedAt   time.Time
	sinceSave int // acks since
	connected bool
	since     time.Time
	lastErr   string
	rate      float64 // acks per second over the last second
	rateBase  uint64
	rateAt    time.Time
	dropping  bool // drop_oldest is dropping (for one log line per episode)
	c         Counters
}

// Counters are the uplink's running totals, for tandem_uplink_* metrics
// (counters, labelled by uplink name).
type Counters struct {
	Forwarded        uint64 // messages acked by the cloud (QoS 0: written)
	ForwardedBytes   uint64 // their payload bytes
	Resent           uint64 // messages sent again after a reconnect: duplicates the cloud may see
	Dropped          uint64 // records skipped by on_full: drop_oldest
	Lost             uint64 // log indexes retention dropped before they were forwarded
	Connects         uint64 // connections established
	ConnectFailures  uint64 // attempts that failed
	Disconnects      uint64 // established connections that ended
	DownlinkReceived uint64 // downlink messages published locally and acked to the cloud
	DownlinkFailed   uint64 // downlink messages whose local publish failed (left unacked)
}

// Status is an uplink's state for /v1/status `uplinks` and `tandem
// status`; the JSON names are the contract's.
type Status struct {
	Name             string     `json:"name"`
	Connected        bool       `json:"connected"`
	Since            *time.Time `json:"since"` // when connected became what it is; null before the first attempt
	LastError        string     `json:"last_error"`
	BacklogRecords   int64      `json:"backlog_records"`
	BacklogBytes     int64      `json:"backlog_bytes"`
	OldestAgeSeconds float64    `json:"oldest_age_seconds"`
	Rate             float64    `json:"rate"` // forwarded messages per second
	// ReplayETASeconds is how long the backlog takes at the current rate:
	// 0 with no backlog, null while nothing is being forwarded.
	ReplayETASeconds *float64 `json:"replay_eta_seconds"`
	Running          bool     `json:"running"`
	Paused           bool     `json:"paused"`
	Position         uint64   `json:"position"`
	Full             bool     `json:"full"`
}

// New checks cfg and reads its password and TLS files; the uplink runs
// once Start is called.
func New(cfg Config, deps Deps) (*Uplink, error) {
	if err := cfg.Validate(deps.Filters); err != nil {
		return nil, fmt.Errorf("uplink %q: %w", cfg.Name, err)
	}
	cfg = cfg.withDefaults()
	if deps.Log == nil || deps.Positions == nil || deps.Filters.Match == nil {
		return nil, fmt.Errorf("uplink %q: a log, a position sink and a filter matcher are required", cfg.Name)
	}
	if len(cfg.Downlink) > 0 && deps.Local == nil {
		return nil, fmt.Errorf("uplink %q: a downlink needs a local publisher", cfg.Name)
	}
	u := &Uplink{
		cfg:    cfg,
		match:  deps.Filters.Match,
		log:    deps.Log,
		sink:   deps.Positions,
		local:  deps.Local,
		logger: deps.Logger,
		wake:   make(chan struct{}, 1),
	}
	if u.logger == nil {
		u.logger = slog.Default()
	}
	u.logger = u.logger.With("uplink", cfg.Name)
	if cfg.PasswordFile != "" {
		b, err := os.ReadFile(cfg.PasswordFile)
		if err != nil {
			return nil, fmt.Errorf("uplink %q: password_file: %w", cfg.Name, err)
		}
		u.password = []byte(strings.TrimRight(string(b), "\r\n"))
	}
	scheme, addr, _ := brokerAddr(cfg.Broker)
	if scheme == "tls" {
		tc, err := tlsConfig(cfg.TLS, addr)
		if err != nil {
			return nil, fmt.Errorf("uplink %q: tls: %w", cfg.Name, err)
		}
		u.tlsConf = tc
	}
	u.backoff = autopaho.NewExponentialBackoff(cfg.ReconnectMin, cfg.ReconnectMax,
		min(2*cfg.ReconnectMin, cfg.ReconnectMax), 2)
	return u, nil
}

// tlsConfig builds the client TLS config of a tls:// uplink.
func tlsConfig(f TLSFiles, addr string) (*tls.Config, error) {
	host := addr
	if i := strings.LastIndexByte(addr, ':'); i >= 0 {
		host = strings.Trim(addr[:i], "[]")
	}
	tc := &tls.Config{ServerName: host, MinVersion: tls.VersionTLS12}
	if f.CAFile != "" {
		pem, err := os.ReadFile(f.CAFile)
		if err != nil {
			return nil, fmt.Errorf("ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("ca_file %s: no PEM certificate in it", f.CAFile)
		}
		tc.RootCAs = pool
	}
	if (f.CertFile == "") != (f.KeyFile == "") {
		return nil, errors.New("cert_file and key_file go together")
	}
	if f.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("cert_file/key_file: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// Name is the uplink's name.
func (u *Uplink) Name() string { return u.cfg.Name }

// Start runs the uplink from position (every record up to it dealt with:
// the replicated position, 0 for none) with the log committed up to
// committed. Only the master calls it; Stop ends it. Starting a running
// uplink does nothing.
func (u *Uplink) Start(position, committed uint64) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.running {
		return
	}
	u.running = true
	u.stopc = make(chan struct{})
	u.pos, u.readUpTo, u.saved, u.counted = position, position, position, position
	u.committed = max(u.committed, committed, position)
	u.caughtUp = u.committed == position // else run counts the gap first
	u.inflight, u.highSent = 0, position
	u.backlogN, u.backlogB = 0, 0
	u.savedAt, u.rateAt, u.rateBase = time.Now(), time.Now(), u.c.Forwarded
	stopc := u.stopc
	u.wg.Add(2)
	go u.run(stopc)
	go u.housekeep(stopc)
}

// Stop ends the uplink (this member is no longer master, or the daemon
// stops): the connection is closed, the goroutines are waited for and the
// position is saved one last time.
func (u *Uplink) Stop() {
	u.mu.Lock()
	if !u.running {
		u.mu.Unlock()
		return
	}
	u.running = false
	close(u.stopc)
	if u.cutConn != nil {
		u.cutConn()
	}
	u.mu.Unlock()
	u.wg.Wait()
	u.savePosition(true)
	u.mu.Lock()
	u.connected, u.since = false, time.Now()
	u.mu.Unlock()
}

// Notify tells the uplink that the record at index is committed (past its
// ack rule), with its topic and size in the log. The daemon's applier
// calls it for every record, in log order, whether or not the uplink runs
// (indexes that hold no record may be skipped). It never blocks.
func (u *Uplink) Notify(index uint64, topic string, size int) {
	u.mu.Lock()
	if index <= u.committed {
		u.mu.Unlock()
		return
	}
	u.committed = index
	if u.running && u.caughtUp {
		u.counted = index
		if u.ruleFor(topic) != nil {
			u.backlogN++
			u.backlogB += int64(size)
		}
	}
	u.mu.Unlock()
	u.kick()
}

func (u *Uplink) kick() {
	select {
	case u.wake <- struct{}{}:
	default:
	}
}

// Pause closes the connection and keeps it closed until Resume (`tandem
// uplink pause`): the backlog grows meanwhile, within max_backlog.
func (u *Uplink) Pause() {
	u.mu.Lock()
	u.paused = true
	if u.cutConn != nil {
		u.cutConn()
	}
	u.mu.Unlock()
	u.kick()
}

// Resume lets a paused uplink connect again at once.
func (u *Uplink) Resume() {
	u.mu.Lock()
	u.paused = false
	u.mu.Unlock()
	u.kick()
}

// Full reports whether the backlog has reached max_backlog.
func (u *Uplink) Full() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.fullLocked()
}

func (u *Uplink) fullLocked() bool {
	return u.cfg.MaxBacklog > 0 && u.backlogB >= u.cfg.MaxBacklog
}

// Refuses reports whether a publish to topic must be refused (MQTT 5
// 0x97) because this running uplink forwards topic, its backlog is full
// and its on_full is refuse. The publish path asks it of every uplink.
func (u *Uplink) Refuses(topic string) bool {
	if u.cfg.OnFull != OnFullRefuse || u.cfg.MaxBacklog == 0 {
		return false
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.running && u.fullLocked() && u.ruleFor(topic) != nil
}

// Forwards reports whether the uplink forwards records on topic: the
// daemon holds its notifications back at a sync record it forwards until
// the record is settled (DESIGN.md, "Delivery waits for the ack rule").
func (u *Uplink) Forwards(topic string) bool { return u.ruleFor(topic) != nil }

// Position is the uplink's current position (not necessarily saved yet).
func (u *Uplink) Position() uint64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.pos
}

// Counters returns the running totals.
func (u *Uplink) Counters() Counters {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.c
}

// Status returns the uplink's state now. It reads the log to find the
// oldest undelivered record, so call it at human rates.
func (u *Uplink) Status() Status {
	u.mu.Lock()
	s := Status{
		Name:           u.cfg.Name,
		Connected:      u.connected,
		LastError:      u.lastErr,
		BacklogRecords: max(u.backlogN, 0),
		BacklogBytes:   max(u.backlogB, 0),
		Rate:           u.rate,
		Running:        u.running,
		Paused:         u.paused,
		Position:       u.pos,
		Full:           u.fullLocked(),
	}
	if !u.since.IsZero() {
		t := u.since
		s.Since = &t
	}
	if eta := 0.0; s.BacklogRecords == 0 {
		s.ReplayETASeconds = &eta
	} else if u.rate > 0 {
		eta = float64(s.BacklogRecords) / u.rate
		s.ReplayETASeconds = &eta
	}
	from, to := u.pos+1, u.counted
	u.mu.Unlock()
	if s.BacklogRecords > 0 && from <= to {
		n := 0
		_ = u.log.Committed(from, to, func(r *Record) bool {
			n++
			if u.ruleFor(r.Topic) != nil {
				s.OldestAgeSeconds = max(0, clock.Now().Sub(time.Unix(0, r.Time)).Seconds())
				return false
			}
			return n < oldestScanLimit
		})
	}
	return s
}

// ruleFor is the topic rule a record's topic goes up under, nil for none:
// a $ topic never (tandem's control records), nor what this uplink's own
// downlink brought in (a loop).
func (u *Uplink) ruleFor(topic string) *TopicRule {
	if strings.HasPrefix(topic, serverPrefix) {
		return nil
	}
	for i := range u.cfg.Downlink {
		if p := u.cfg.Downlink[i].LocalPrefix; p != "" && strings.HasPrefix(topic, p) {
			return nil
		}
	}
	for i := range u.cfg.Topics {
		if u.match(u.cfg.Topics[i].Match, topic) {
			return &u.cfg.Topics[i]
		}
	}
	return nil
}

// setError records err as the last error (and logs it).
func (u *Uplink) setError(err error) {
	if err == nil {
		return
	}
	u.mu.Lock()
	changed := u.lastErr != err.Error()
	u.lastErr = err.Error()
	u.mu.Unlock()
	if changed {
		u.logger.Warn("uplink error", "error", err)
	}
}

// savePosition hands the position to the sink when it moved and a batch is
// due (or force).
func (u *Uplink) savePosition(force bool) {
	u.saveMu.Lock()
	defer u.saveMu.Unlock()
	u.mu.Lock()
	pos := u.pos
	due := pos > u.saved && (force || u.sinceSave >= SaveAcks || time.Since(u.savedAt) >= SaveEvery)
	if due {
		u.saved, u.savedAt, u.sinceSave = pos, time.Now(), 0
	}
	u.mu.Unlock()
	if due {
		u.sink.Save(u.cfg.Name, pos)
	}
}

// housekeep saves the position in batches and measures the forward rate.
func (u *Uplink) housekeep(stopc chan struct{}) {
	defer u.wg.Done()
	t := time.NewTicker(SaveEvery)
	defer t.Stop()
	for {
		select {
		case <-stopc:
			return
		case now := <-t.C:
			u.savePosition(false)
			u.mu.Lock()
			if d := now.Sub(u.rateAt); d >= time.Second {
				u.rate = float64(u.c.Forwarded-u.rateBase) / d.Seconds()
				u.rateBase, u.rateAt = u.c.Forwarded, now
			}
			u.mu.Unlock()
		}
	}
}
