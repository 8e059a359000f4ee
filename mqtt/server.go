package mqtt

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// LogReader is the read side of the log a Server needs: committed records,
// for sessions that replay from their cursor (a client back from offline,
// or one that fell further behind than its queue holds).
type LogReader interface {
	// Committed calls fn for each record with from <= index <= to, in log
	// order, until fn returns false; m is fn's to keep. The server asks
	// only up to the last index it was handed (Deliver, Applied), which is
	// committed: an implementation must not stop short of to for any
	// other reason than fn, or a replay would skip what it did not read.
	Committed(from, to uint64, fn func(index uint64, m *Message) bool) error
}

// Retained is a LogReader whose log drops its oldest records (retention):
// FirstIndex is the oldest index it still holds, so a session replaying
// from below it can count what it lost.
type Retained interface {
	FirstIndex() uint64
}

// Server is tandem's own MQTT broker on mochi's packets codec: listeners,
// connections (a read loop and one writer each), sessions as cursors into
// the log, the subscription index and the retained store. See doc.go.
type Server struct {
	cfg          Config
	log          Log
	reader       LogReader    // nil: replays find nothing
	lines        *slog.Logger // rate-limited: info and warnings once a minute per message and client
	refusalLines *slog.Logger // cfg.Logger, for lines limited by refusals
	refusals     *LogLimiter  // refused clients and packets: once a minute per reason and source
	store        SessionStore // nil: sessions and retained messages live in memory only

	access atomic.Pointer[Access]
	// redirect is non-nil while this member sends devices elsewhere
	// (Redirect).
	redirect atomic.Pointer[redirection]
	topics   atomic.Pointer[[]TopicPolicy]
	tlsConf  atomic.Pointer[tls.Config]

	connRate     *connRate     // nil: no connect rate limit
	openConns    atomic.Int64  // sockets accepted and not yet closed, all listeners
	rateTelling  atomic.Int64  // of those, over the connect rate and being refused (listen.go)
	maxOpenConns int64         // sockets beyond it are closed at once
	bcryptSem    chan struct{} // bounds concurrent password checks
	preAuth      *byteBudget   // bytes buffered for connections not yet authenticated
	logins       loginBackoff  // failed logins by source and user
	conns        connCounts    // connected clients by source and user

	tcp, tlsLn *srvListener
	ws         *wsListener // nil without a WebSocket listener

	mu       sync.Mutex          // guards sessions and wills
	sessions map[string]*session // by client id, online and offline
	refs     map[uint64]*session // by ref (cursors.go); stale entries are checked for
	wills    map[string]*pendingWill

	index    *topicIndex
	retained *retainStore
	routes   routeCache

	// applied is the last log index whose Deliver (or Applied) is done:
	// every session it matched has been offered it. handed is the last
	// index Deliver has been given, ahead of applied while Deliver offers
	// it: committed, so a replay reads up to there, or a record offered
	// to a session that is behind would be in neither its queue nor its
	// replay.
	applied, handed atomic.Uint64
	holds           holds               // sync records held or aborted (hold.go)
	skipMu          sync.Mutex          // guards skip
	skip            map[uint64]struct{} // indexes delivered before a rejoin (Delivered)
	clients         atomic.Int64        // connected clients
	inflight        atomic.Int64        // QoS 1/2 messages in flight, both directions
	mem             *memAccount         // what clients make the gateway hold (limits.memory)
	memHeld         atomic.Int64        // connections not read from for memory now
	qos0Dropped     atomic.Uint64       // QoS 0 messages connected sessions could not take (outbudget.go)
	sessionBytes    atomic.Int64        // what persistent sessions count against max_session_bytes
	pageCounts      atomic.Bool         // the caps count pages, not bytes (counts.go); the applier sets it
	capsApplied     atomic.Bool         // the retained caps are applied at apply (counts.go); the applier sets it

	wg      sync.WaitGroup // every goroutine the server starts
	stopc   chan struct{}
	closing atomic.Bool

	idleSlot // the idler of parked connections (readpark.go)

	// scratch is Deliver's per-record list of matching sessions; Deliver
	// runs on one goroutine.
	scratch []target
	// offered, set by tests only, runs in Deliver after a record's offers
	// and before it counts as applied: a test starts a replay there.
	offered func(index uint64)
	// handedHook, set by tests only, runs in Deliver right after a
	// device message's index is handed to replays.
	handedHook func(index uint64)
}

// target is one session a record goes to, its matching subscriptions
// merged: the highest QoS, every subscription identifier [MQTT-3.3.4-3]
// [MQTT-3.3.4-4].
type target struct {
	s   *session
	qos byte
	rap bool
	ids []int
}

// preAuthBudget bounds the bytes buffered across every connection whose
// CONNECT is not yet authenticated, and preAuthMaxPacket one such packet:
// strangers cannot make the gateway allocate before they log in.
const (
	preAuthBudget    = 8 << 20
	preAuthMaxPacket = 64 << 10
)

// NewServer builds a Server that logs publishes through log; if log also
// implements LogReader, sessions replay from it.
func NewServer(cfg Config, log Log) (*Server, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	mem := newMemAccount(cfg.Limits.Memory)
	s := &Server{cfg: cfg, log: log,
		lines:        slog.New(limitedHandler{cfg.Logger.Handler(), NewLogLimiter(time.Minute)}),
		refusalLines: cfg.Logger,
		refusals:     NewLogLimiter(time.Minute),
		store:        cfg.Sessions,
		connRate:     newConnRate(cfg.Limits.ConnectRate, cfg.Limits.ConnectBurst),
		maxOpenConns: int64(2*cfg.Limits.MaxClients + 16),
		bcryptSem:    make(chan struct{}, max(1, runtime.GOMAXPROCS(0)/2)),
		preAuth:      &byteBudget{max: preAuthBudget},
		mem:          mem,
		sessions:     map[string]*session{},
		wills:        map[string]*pendingWill{},
		index:        newTopicIndex(),
		retained:     newRetainStore(&cfg.Limits, cfg.Sessions, mem),
		stopc:        make(chan struct{}),
	}
	s.reader, _ = log.(LogReader)
	s.rawReads.Store(true)
	s.inlineWrites.Store(true)
	s.parkIdle.Store(true)
	s.access.Store(&Access{AllowAnonymous: cfg.AllowAnonymous, Users: cfg.Users, ACL: cfg.ACL})
	s.SetTopics(cfg.Topics)
	s.tcp = &srvListener{id: listenerID, addr: cfg.Listen, srv: s}
	if err := s.tcp.listen(); err != nil {
		return nil, fmt.Errorf("mqtt: listen %s: %w", cfg.Listen, err)
	}
	if cfg.TLS != nil {
		conf, err := loadTLS(cfg.TLS)
		if err != nil {
			s.tcp.stopAccepting()
			return nil, err
		}
		s.tlsConf.Store(conf)
		// Every handshake takes the configuration of the moment, so
		// ReloadTLS can change certificates under a running listener.
		outer := &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return s.tlsConf.Load(), nil }}
		s.tlsLn = &srvListener{id: tlsListenerID, addr: cfg.TLS.Listen, tls: outer, srv: s}
		if err := s.tlsLn.listen(); err != nil {
			s.tcp.stopAccepting()
			return nil, fmt.Errorf("mqtt: tls listen %s: %w", cfg.TLS.Listen, err)
		}
	}
	if cfg.WebSocket != nil {
		ws, err := newWSListener(s, cfg.WebSocket)
		if err != nil {
			s.tcp.stopAccepting()
			if s.tlsLn != nil {
				s.tlsLn.stopAccepting()
			}
			return nil, fmt.Errorf("mqtt: websocket listen %s: %w", cfg.WebSocket.Listen, err)
		}
		s.ws = ws
	}
	return s, nil
}

// fill checks c and fills in its defaults.
func (c *Config) fill() error {
	if c.MaxInflight <= 0 {
		c.MaxInflight = 1024
	}
	if c.MaxInflight > 65535 {
		return fmt.Errorf("mqtt: max_inflight %d exceeds 65535", c.MaxInflight)
	}
	if c.MaxPacketSize == 0 {
		c.MaxPacketSize = 1 << 20
	}
	if c.TakeoverWait == 0 {
		c.TakeoverWait = 5 * time.Second
	}
	if c.TopicAliasMaximum == 0 {
		c.TopicAliasMaximum = 100
	}
	if c.MaxQueued <= 0 {
		c.MaxQueued = 1000
	}
	if c.MaxQueuedBytes <= 0 {
		c.MaxQueuedBytes = 4 << 20
	}
	if c.MaxInflightOut <= 0 {
		c.MaxInflightOut = 100
	}
	if c.MaxInflightOutBytes <= 0 {
		c.MaxInflightOutBytes = 4 << 20
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	c.Limits.setDefaults()
	return nil
}

// go runs f on a goroutine that Stop waits for.
func (s *Server) goFunc(f func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
}

// SetAccess replaces the users, ACLs and anonymous rule. Connected clients
// stay connected; their next subscribe, publish or delivery is checked
// against the new rules.
func (s *Server) SetAccess(a Access) { s.access.Store(&a) }

// SetTopics replaces the topic ack rules; publishes taken after it returns
// are acked by the new rules.
func (s *Server) SetTopics(p []TopicPolicy) {
	p = slices.Clone(p)
	s.topics.Store(&p)
}

func (s *Server) topicPolicies() []TopicPolicy { return *s.topics.Load() }

// ReloadTLS reads the TLS listener's certificate, key and client CAs
// again; new handshakes use them. On error the previous ones stay.
func (s *Server) ReloadTLS() error {
	if s.tlsLn == nil {
		return nil
	}
	conf, err := loadTLS(s.cfg.TLS)
	if err != nil {
		return err
	}
	s.tlsConf.Store(conf)
	return nil
}

// Addr returns the TCP listener's address (useful with port 0).
func (s *Server) Addr() string { return s.tcp.address() }

// TLSAddr returns the TLS listener's address, or "" without one.
func (s *Server) TLSAddr() string {
	if s.tlsLn == nil {
		return ""
	}
	return s.tlsLn.address()
}

// Start loads the persisted sessions and retained messages and starts
// serving.
func (s *Server) Start() error {
	if err := s.load(); err != nil {
		return fmt.Errorf("mqtt: loading sessions: %w", err)
	}
	s.goFunc(s.tcp.serve)
	s.lines.Info("mqtt listening", "addr", s.Addr())
	if s.tlsLn != nil {
		s.goFunc(s.tlsLn.serve)
		s.lines.Info("mqtt tls listening", "addr", s.TLSAddr(), "client_certs", s.cfg.TLS.RequireClientCert)
	}
	if s.ws != nil {
		s.goFunc(s.ws.serve)
		s.lines.Info("mqtt websocket listening", "addr", s.WSAddr(), "tls", s.cfg.WebSocket.TLS)
	}
	s.goFunc(s.sweeper)
	return nil
}

// WSAddr returns the WebSocket listener's address, or "" without one.
func (s *Server) WSAddr() string {
	if s.ws == nil {
		return ""
	}
	return s.ws.lst.address()
}

// Stop closes the listeners and every connection (MQTT 5 clients get
// DISCONNECT 0x8B); the wills of the clients it disconnects are proposed
// as records, delayed ones are dropped (they are not due). It returns once
// every goroutine of the server has ended.
func (s *Server) Stop() error {
	if s.closing.Swap(true) {
		return nil
	}
	close(s.stopc)
	lns := []*srvListener{s.tcp}
	if s.tlsLn != nil {
		lns = append(lns, s.tlsLn)
	}
	if s.ws != nil {
		lns = append(lns, s.ws.lst)
	}
	for _, l := range lns {
		l.stopAccepting()
	}
	if s.ws != nil {
		_ = s.ws.http.Close() // requests not yet upgraded
	}
	for _, c := range s.onlineConns() {
		c.end(codeShutdown)
	}
	for _, l := range lns {
		l.close()
	}
	if s.ws != nil {
		s.ws.active.Wait()
	}
	s.wg.Wait()
	s.mu.Lock()
	for id, w := range s.wills {
		s.dropWillLocked(id, w)
	}
	s.mu.Unlock()
	if s.store != nil {
		s.saveCursors()
		return s.store.Sync()
	}
	return nil
}

// onlineConns returns the connections of the sessions now online.
func (s *Server) onlineConns() []*conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*conn
	for _, se := range s.sessions {
		if c := se.current(); c != nil {
			out = append(out, c)
		}
	}
	return out
}

// Clients returns the number of connected clients.
func (s *Server) Clients() int64 { return s.clients.Load() }

// Inflight returns the QoS 1/2 messages in flight, both directions.
func (s *Server) Inflight() int64 { return s.inflight.Load() }

// Retained returns how many retained messages the server holds.
func (s *Server) Retained() int64 { return int64(s.retained.len()) }

// Applied tells the server that the log has been applied up to index, for
// records that Deliver was not given (nobody subscribed): a session that
// replays reads up to there.
func (s *Server) Applied(index uint64) {
	s.hand(index)
	if index > s.applied.Load() {
		s.applied.Store(index)
	}
}

// hand notes that the applier has given the broker the record at index.
// Only the applier goroutine moves it forward.
func (s *Server) hand(index uint64) {
	if index > s.handed.Load() {
		s.handed.Store(index)
	}
}

// setApplied moves both counters to index, back or forth: the log was
// replaced.
func (s *Server) setApplied(index uint64) {
	s.handed.Store(index)
	s.applied.Store(index)
}

// Delivered tells the server that the record at index was delivered here
// already, before the log was replaced (a deposed master's tail coming
// back re-published): it is applied as Applied is, and a session that
// replays the log skips it too, as the live path does.
func (s *Server) Delivered(index uint64) {
	s.skipMu.Lock()
	if s.skip == nil || len(s.skip) >= maxSkip {
		s.skip = map[uint64]struct{}{} // bounded: a replay this far back is rare
	}
	s.skip[index] = struct{}{}
	s.skipMu.Unlock()
	s.Applied(index)
}

// maxSkip bounds the indexes Delivered remembers.
const maxSkip = 1 << 20

// skipped reports whether Delivered named index.
func (s *Server) skipped(index uint64) bool {
	s.skipMu.Lock()
	defer s.skipMu.Unlock()
	_, ok := s.skip[index]
	return ok
}

// Rewind follows a replaced log (a join, a deposed master's rejoin):
// applied is the new log's applied index; retained messages that records
// past it set are dropped, and every session's cursor is set to at most
// applied and at least skip, the end of a joined cluster's history, which
// no session is to be handed.
func (s *Server) Rewind(applied, skip uint64) {
	s.setApplied(applied)
	s.retained.dropPending()
	// The retained store is a function of the log: what records past
	// applied set is gone with them (a wiped log, a deposed master's
	// tail), and the new log's records set it again as they apply.
	gone := s.retained.removeIf(func(r *retained) bool {
		return r.index > applied || applied == 0 // 0: the log was wiped, even what an earlier build stored without an index goes
	})
	for _, t := range gone {
		s.stageDelete(keyRetained + t)
	}
	s.rewindHolds(applied)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, se := range s.sessions {
		se.mu.Lock()
		se.cursor = max(min(se.cursor, applied), skip)
		se.scanned = se.cursor
		// What the queue holds of the old log is gone with it: handed out,
		// an old index past the cursor would move it over the new log's
		// records there. The new log is read for them instead.
		// Retained messages sent on subscribe (index 0) stay.
		queued := len(se.queue)
		se.queue = slices.DeleteFunc(se.queue, func(it *outItem) bool {
			if it.idx > 0 {
				se.unqueuedLocked(it)
			}
			return it.idx > 0
		})
		c := se.conn
		replay := c != nil && len(se.queue) < queued
		if replay {
			se.behind, se.more = true, true
		}
		se.mu.Unlock()
		if replay {
			c.kick()
		}
	}
}

// Deliver hands the committed record at index to the retained store and
// to every session it matches. It is called in log order from one
// goroutine and never blocks on a session: each session takes the record
// into its bounded queue or, when that is full or its client offline,
// reads it from the log later.
func (s *Server) Deliver(index uint64, m *Message) error {
	defer s.Applied(index)
	if m.Kind != KindMessage {
		s.hand(index)
		s.applyControl(index, m)
		return nil
	}
	if m.Retain && m.Origin == s.cfg.NodeID {
		defer s.retained.applied(m.Seq) // after retain: counted in the store by then
	}
	if s.inboundDup(index, m) {
		s.handMessage(index)
		return nil // delivered once already, or to be: its other copy
	}
	if m.QoS == 2 && m.PacketID != 0 && !m.Will && m.Origin != s.cfg.NodeID {
		s.noteInbound(m)
	}
	if m.Sync {
		s.hold(index, m) // offered now, handed out once confirmed
	}
	if _, live := m.expiryLeft(s.cfg.Now()); !live {
		s.handMessage(index)
		return nil // its message expiry ran out before it was delivered
	}
	// A record past the retained caps is delivered as a plain message:
	// not retained, nor flagged so to those who asked for the flag as
	// published.
	retain := m.Retain
	if m.Retain && !m.Sync {
		if retain = s.retain(index, m); retain {
			s.supersedeHeld(m.Topic)
		}
	}
	// Handed to replays before any offer (a replay under way must read
	// it), and only once the retained store has it: a session that
	// subscribes in between finds it there, and one that subscribes
	// after is offered it. Handed first, a new session's first replay,
	// before its SUBSCRIBE, moved past it, the SUBSCRIBE then found the
	// store without it, and the offer was taken for the replay's.
	s.handMessage(index)
	ts := s.scratch[:0]
	s.index.match(m.Topic, func(se *session, sub *subscription) {
		if sub.noLocal && se.id == m.ClientID {
			return // [MQTT-3.8.3-3]
		}
		for i := range ts {
			if ts[i].s == se {
				t := &ts[i]
				t.qos = max(t.qos, sub.qos)
				t.rap = t.rap || sub.rap
				if sub.id > 0 {
					t.ids = append(t.ids, sub.id)
				}
				return
			}
		}
		t := target{s: se, qos: sub.qos, rap: sub.rap}
		if sub.id > 0 {
			t.ids = []int{sub.id}
		}
		ts = append(ts, t)
	})
	for i := range ts {
		t := &ts[i]
		t.s.offer(&outItem{idx: index, m: m, qos: min(m.QoS, t.qos), retain: retain && t.rap, ids: t.ids})
		ts[i] = target{}
	}
	s.scratch = ts[:0]
	if s.offered != nil {
		s.offered(index)
	}
	return nil
}

// handMessage hands a device message's index to replays (Deliver).
func (s *Server) handMessage(index uint64) {
	s.hand(index)
	if s.handedHook != nil {
		s.handedHook(index)
	}
}

// Unrouted reports whether no subscriber matches topic, so that a record
// on it without retain needs neither a Message nor Deliver. The topic is
// still in its record's bytes: a topic seen before costs no allocation.
func (s *Server) Unrouted(topic []byte) bool {
	return s.routes.unrouted(s.index, topic)
}

// Retain applies the committed record at index to the retained store
// only, without delivering it: how a gateway that joins a cluster takes in
// the cluster's history, and how a record already delivered here is
// applied again.
func (s *Server) Retain(index uint64, m *Message) {
	if m.Kind != KindMessage {
		s.applyControl(index, m) // a joiner learns the sessions from the history
		return
	}
	if m.Retain && m.Origin == s.cfg.NodeID {
		defer s.retained.applied(m.Seq)
	}
	if s.inboundDup(index, m) {
		return
	}
	if m.Sync {
		s.hold(index, m) // retained, if at all, once confirmed
		return
	}
	if _, live := m.expiryLeft(s.cfg.Now()); live && m.Retain {
		if s.retain(index, m) {
			s.supersedeHeld(m.Topic)
		}
	}
}

// routeCache remembers, per topic delivered, whether it had subscribers,
// so a record nobody subscribes to skips the tree. A topic without
// subscribers is only trusted while the index's generation has not moved.
type routeCache struct {
	mu     sync.Mutex // guards routes
	routes map[string]route
}

// route is what the cache knows of a topic's subscribers.
type route struct {
	none bool   // no subscriber matched
	gen  uint64 // topicIndex.gen when that was found
}

// maxRoutes bounds the topics remembered; past it they are forgotten.
const maxRoutes = 4096

func (rc *routeCache) unrouted(ti *topicIndex, topic []byte) bool {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	gen := ti.gen.Load() // before the match: a subscription made meanwhile moves it
	if r, ok := rc.routes[string(topic)]; ok && (!r.none || r.gen == gen) {
		return r.none
	}
	t := string(topic)
	none := !ti.any(t)
	if rc.routes == nil || len(rc.routes) >= maxRoutes {
		rc.routes = make(map[string]route)
	}
	rc.routes[t] = route{none: none, gen: gen}
	return none
}

// byteBudget is a count of bytes shared by many holders, bounded.
type byteBudget struct {
	mu   sync.Mutex // guards used
	used int
	max  int
}

// take reserves n bytes, or reports false when they would pass the bound.
func (b *byteBudget) take(n int) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used+n > b.max {
		return false
	}
	b.used += n
	return true
}

func (b *byteBudget) give(n int) {
	b.mu.Lock()
	b.used -= n
	b.mu.Unlock()
}

// observer returns cfg.Observer, or one that does nothing.
func (s *Server) observer() Observer {
	if s.cfg.Observer == nil {
		return nopObserver{}
	}
	return s.cfg.Observer
}

// refusal logs a refused client or packet at warning level, once a minute
// per reason and key: the source address, or the client id for refusals of
// a connected client ("" for those tied to neither).
func (s *Server) refusal(key, reason string, args ...any) {
	s.observer().Refused(reason)
	ok, held := s.refusals.Allow(reason+"\x00"+key, time.Now())
	if !ok {
		return
	}
	if held > 0 {
		args = append(args, "suppressed", held)
	}
	s.refusalLines.Warn("client refused: "+reason, args...)
}

// checkPassword runs the bcrypt comparison, at most a few at a time: each
// one is tens of milliseconds of CPU (more on ARM), and a flood of CONNECTs
// must not take the CPU the log needs. A client that waits longer than the
// connect deadline for its turn is refused.
func (s *Server) checkPassword(u *Users, user string, password []byte) bool {
	t := time.NewTimer(s.cfg.Limits.ConnectTimeout)
	defer t.Stop()
	select {
	case s.bcryptSem <- struct{}{}:
	case <-t.C:
		return false
	}
	defer func() { <-s.bcryptSem }()
	return u.Check(user, password)
}
