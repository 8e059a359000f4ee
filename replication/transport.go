package replication

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
)

// Transport errors; test with errors.Is.
var (
	// ErrPeerUnknown means the node id is not in the member set.
	ErrPeerUnknown = errors.New("replication: not a member peer")
	// ErrPeerUnreachable means there is no connection to the peer, its
	// send queue is full, or the connection was lost before the answer (the
	// request may or may not have been handled: retry only what is safe to
	// repeat, such as records, which carry their id).
	ErrPeerUnreachable = errors.New("replication: peer unreachable")
	// ErrPeerIdentity means the certificate at the address is not the one
	// pinned for it: another node, or an impostor.
	ErrPeerIdentity = errors.New("replication: peer certificate is not the pinned one")
	// ErrTransportClosed means Close was called.
	ErrTransportClosed = errors.New("replication: transport closed")
	// ErrRemote wraps the text of an error the peer's handler returned.
	ErrRemote = errors.New("replication: peer answered with an error")
	// ErrNotSent is also wrapped by a Request error when the request never
	// left this node (no link while the context lasted, a full send queue,
	// a context already over): the peer cannot have handled it. Any other
	// error leaves that open, which the forward stream must know: a record
	// that may have reached the master is never reported refused on a
	// guess (forward.go).
	ErrNotSent = errors.New("replication: request not sent")
)

const (
	peerALPN         = "tandem-peer/1"
	handshakeTimeout = 10 * time.Second // TCP + TLS + hellos
	knockTimeout     = 30 * time.Second // a stranger's request, handler included
	minBackoff       = 50 * time.Millisecond
	maxBackoff       = 5 * time.Second
	stableAfter      = time.Second // a link that lived this long resets the backoff
	// firstHelloTimeout bounds, on an accepted connection, the TLS
	// handshake and the dialler's hello: a peer sends both at once, so
	// only a stalled or hostile socket needs longer (admission.go).
	firstHelloTimeout = 2 * time.Second
	// knockFrameTimeout bounds the wait for the knock after the hellos;
	// a knocker has its payload ready by then.
	knockFrameTimeout = 2 * time.Second
	// DefaultMaxStrangers is TransportConfig.MaxStrangers's default:
	// connections not yet proven a member's, at once (admission.go).
	DefaultMaxStrangers = 64
	// DefaultMaxStrangersPerSource is the default of
	// TransportConfig.MaxStrangersPerSource.
	DefaultMaxStrangersPerSource = 2
	reservedStrangers            = 16          // more slots, for member hosts when no stranger can be evicted
	maxKnocks                    = 4           // stranger requests being handled at once, shared
	reservedKnocks               = 2           // more of them, for member hosts (a deposed master's rejoin)
	srcKnocks                    = 1           // stranger requests per source address
	maxHandlers                  = 1024        // OnRequest calls in flight per connection
	logEvery                     = time.Minute // rate of repeated refusal lines per address
)

// PeerInfo is what the transport needs to know of one member.
type PeerInfo struct {
	ID          uint64
	Addrs       []string // host:port, tried in turn
	Fingerprint [32]byte // SHA-256 of its certificate (DER), pinned
}

// Remote is the other end of a connection, as its TLS handshake and hello
// proved it: ID matches the certificate's key, Fingerprint is the
// certificate's. Generation and ClusterID are what it claims.
type Remote struct {
	ID          uint64
	Fingerprint [32]byte
	Addr        string
	Generation  uint64
	ClusterID   string
	// Protocol is the peer protocol version the link speaks, Level the
	// highest feature level the peer's build knows, Build its release
	// ("" from builds before they said).
	Protocol uint16
	Level    int
	Build    string
	// Binding is this TLS connection's exporter value (RFC 8446 7.5, label
	// BindingLabel, 32 bytes): the same on both ends of one connection,
	// different on any other. A proof computed over it (a pairing MAC)
	// cannot be relayed to another connection by a man in the middle.
	Binding []byte
}

// BindingLabel is the TLS exporter label of Remote.Binding.
const BindingLabel = "EXPORTER-tandem-pair"

// TransportConfig configures a PeerTransport. Callbacks may be called from
// several transport goroutines at once, hold no transport lock (they may
// call its methods, Close excepted) and nil ones take a harmless default.
type TransportConfig struct {
	// Identity is this node's key, certificate and id (required).
	Identity *Identity
	// Listen is the peer port's address ("" to only dial, e.g. to Knock).
	Listen string
	// LocalAddr, if set, is the address this node dials from (a host of
	// several addresses may pin the one its peers know it by); nil leaves
	// the choice to the routing table.
	LocalAddr *net.TCPAddr
	// Peers is the initial member set; see SetPeers.
	Peers []PeerInfo
	// Logger receives connection events; nil discards them.
	Logger *slog.Logger
	// ClusterID, if set, is sent in every hello; a member link to a peer
	// naming another non-empty cluster id is refused.
	ClusterID func() string
	// Generation is this node's cluster generation, read at each handshake.
	Generation func() uint64
	// OnGeneration sees each member's generation as its hello arrives,
	// before any raft frame is exchanged on that connection; false refuses
	// the connection (DESIGN.md: a node that meets a higher generation
	// must wipe before it talks raft). Nil accepts all.
	OnGeneration func(from, gen uint64) bool
	// FeatureLevel is the cluster's feature level, read at each member
	// handshake: a member whose build knows less is refused, since the
	// log may hold records it cannot read. Nil means storage.FeatureBase.
	FeatureLevel func() int
	// OnRaft receives raft messages from member from, already checked to be
	// From that member and To this node, in the order sent on one link (a
	// pair's two links may reorder, which raft tolerates). It may block
	// briefly: that holds up reading from that link only.
	OnRaft func(from uint64, msgs []pb.Message)
	// OnUnreachable is told that messages to id were dropped or its link
	// went down (raft's ReportUnreachable). It is called from a transport
	// goroutine, never from inside Send, and must not block.
	OnUnreachable func(id uint64)
	// OnSnapshot reports a MsgSnap's fate (raft's ReportSnapshot): ok once
	// it is written to the socket, false if it was dropped. Same threading
	// as OnUnreachable.
	OnSnapshot func(to uint64, ok bool)
	// OnRequest answers a member's Request. ctx ends when the requester's
	// deadline passes or the connection closes; return soon after: Close
	// waits for handlers. Nil answers every request with an error.
	OnRequest func(ctx context.Context, from uint64, kind byte, payload []byte) ([]byte, error)
	// OnStranger answers the one knock (KnockJoin or KnockPair) a
	// connection may make, from a stranger or a member; the connection
	// then closes. Its error's text is sent back. Nil refuses knocks.
	OnStranger func(ctx context.Context, r Remote, kind byte, payload []byte) ([]byte, error)
	// QueueMessages and QueueBytes bound each peer's send queue (defaults
	// 4096 and 16 MiB). A message that does not fit is dropped.
	QueueMessages int
	QueueBytes    int
	// MaxStrangers bounds the accepted connections not yet proven to be
	// a member's (peer.max_strangers; 0 is DefaultMaxStrangers), and
	// MaxStrangersPerSource what one source address may hold of them
	// (peer.max_strangers_per_address; 0 is
	// DefaultMaxStrangersPerSource). See admission.go.
	MaxStrangers          int
	MaxStrangersPerSource int
	// IdleTimeout closes a link on which nothing arrived for this long, or
	// whose writes stall this long (default 10 s); idle links carry a ping
	// every third of it. Members should agree on it: a peer pings at the
	// pace of its own.
	IdleTimeout time.Duration
}

func (c *TransportConfig) validate() error {
	if c.Identity == nil {
		return errors.New("replication: transport needs an Identity")
	}
	if c.QueueMessages < 0 || c.QueueBytes < 0 || c.IdleTimeout < 0 || c.MaxStrangers < 0 || c.MaxStrangersPerSource < 0 {
		return errors.New("replication: negative transport limit")
	}
	if c.Logger == nil {
		c.Logger = discard()
	}
	if c.ClusterID == nil {
		c.ClusterID = func() string { return "" }
	}
	if c.Generation == nil {
		c.Generation = func() uint64 { return 0 }
	}
	if c.OnGeneration == nil {
		c.OnGeneration = func(uint64, uint64) bool { return true }
	}
	if c.OnRaft == nil {
		c.OnRaft = func(uint64, []pb.Message) {}
	}
	if c.OnUnreachable == nil {
		c.OnUnreachable = func(uint64) {}
	}
	if c.OnSnapshot == nil {
		c.OnSnapshot = func(uint64, bool) {}
	}
	if c.OnRequest == nil {
		c.OnRequest = func(context.Context, uint64, byte, []byte) ([]byte, error) {
			return nil, errors.New("no request handler")
		}
	}
	if c.QueueMessages == 0 {
		c.QueueMessages = 4096
	}
	if c.QueueBytes == 0 {
		c.QueueBytes = 16 << 20
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = 10 * time.Second
	}
	if c.MaxStrangers == 0 {
		c.MaxStrangers = DefaultMaxStrangers
	}
	if c.MaxStrangersPerSource == 0 {
		c.MaxStrangersPerSource = DefaultMaxStrangersPerSource
	}
	return nil
}

// TransportStats are counters since the transport was made. Frames and
// bytes count member links (frame headers included, TLS overhead not).
type TransportStats struct {
	FramesSent, FramesReceived uint64
	BytesSent, BytesReceived   uint64
	MsgsSent, MsgsReceived     uint64 // raft messages
	// Dropped counts raft messages not sent: peer unknown or down, queue
	// full, too large, or still queued when a link closed.
	Dropped uint64
	// Refused counts connections closed during or right after the
	// handshake: bad certificate, unknown fingerprint, generation or
	// cluster refused, a stranger doing anything but one knock.
	Refused uint64
	// Knocks counts stranger requests handed to OnStranger.
	Knocks uint64
	// StrangerRefusals counts the connections admission refused or
	// evicted, by the reason StrangerRefusals names.
	StrangerRefusals [numRefusals]uint64
}

// transportCounters are the live counters behind TransportStats; atomic
// types keep them 64-bit aligned on 32-bit ARM.
type transportCounters struct {
	framesSent, framesRecv, bytesSent, bytesRecv atomic.Uint64
	msgsSent, msgsRecv, dropped, refused, knocks atomic.Uint64
	strangers                                    [numRefusals]atomic.Uint64
}

// PeerTransport carries raft messages and tandem's own requests between
// members over TCP + mutual TLS 1.3, each peer pinned by its certificate's
// SHA-256. It implements Transport.
//
// Links: each node dials every member it has an address for and sends on
// the connection it dialled; it falls back to the connection the peer
// dialled when it has none of its own (a peer whose address it does not
// know yet). So a pair may hold two connections. This is deliberate: no
// tie-break between simultaneous dials, no connection torn down because the
// other side won a race, and an address change is handled by whoever dials.
// Two sockets per pair cost nothing at two or three gateways.
//
// Handshake: after TLS the dialling side sends a hello (protocol version,
// purpose, node id, generation, cluster id); the server reads it, checks
// the fingerprint is a member's (or the purpose a knock), answers with its
// own hello and only then asks OnGeneration. The dialler asks OnGeneration
// on the server's hello. Neither side sends or delivers a raft frame on a
// link before its own check passed. Before any of that, an accepted socket
// must be admitted to a stranger slot, held until it proves to be a
// member's: per-source bounds, eviction of the address holding the most
// slots, short deadlines and member hosts first (admission.go) keep
// strangers from locking out a member or a real join.
//
// Queueing: Send never blocks. Each link has a bounded queue (messages and
// bytes); when it is full, or the peer is down, the new message is dropped,
// counted and reported through OnUnreachable. Dropping the new rather than
// the oldest keeps what is queued a contiguous run raft can use, and raft
// retransmits: the report moves the peer to probing, which slows the
// leader down to what the link carries (etcd's rafthttp does the same).
type PeerTransport struct {
	cfg       TransportConfig
	id        uint64
	log       *slog.Logger
	ln        net.Listener
	serverTLS *tls.Config
	stats     transportCounters

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // every goroutine the transport starts

	// mu guards peers, byFP, live, started and closed.
	mu        sync.RWMutex
	peers     map[uint64]*peer
	byFP      map[[32]byte]*peer
	live      map[net.Conn]struct{} // every accepted or dialled socket, for Close
	started   bool
	closed    bool
	closeOnce sync.Once

	strangers *strangerSlots // connections not yet proven a member's (admission.go)
	knocks    *srcLimiter    // knocks being handled
	// seenHosts maps the host each member's last link came from to its
	// id, for admission's reservation; guarded by mu.
	seenHosts map[string]uint64

	levels peerLevels // what each member's build knows (feature.go)

	// notesMu guards unreach and snaps, the reports waiting for notifyLoop.
	notesMu  sync.Mutex
	unreach  map[uint64]struct{}
	snaps    []snapNote
	notesSig chan struct{}

	logMu  sync.Mutex           // guards logged
	logged map[string]time.Time // last time each rate-limited line was logged
}

type snapNote struct {
	to uint64
	ok bool
}

var _ Transport = (*PeerTransport)(nil)

// NewPeerTransport checks cfg and binds the listener, so a port in use is
// reported now. Nothing is accepted or dialled, and no callback runs,
// until Start: the callbacks may refer to a Node made after the transport.
func NewPeerTransport(cfg TransportConfig) (*PeerTransport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	t := &PeerTransport{
		cfg: cfg, id: cfg.Identity.ID, log: cfg.Logger.With("component", "peer"),
		peers: map[uint64]*peer{}, byFP: map[[32]byte]*peer{}, live: map[net.Conn]struct{}{},
		strangers: newStrangerSlots(cfg.MaxStrangers, cfg.MaxStrangersPerSource, reservedStrangers),
		knocks:    newSrcLimiter(maxKnocks, reservedKnocks, srcKnocks), seenHosts: map[string]uint64{},
		unreach: map[uint64]struct{}{}, notesSig: make(chan struct{}, 1), logged: map[string]time.Time{},
	}
	// The server cannot pin at the TLS layer: strangers must get through
	// to knock. RequireAnyClientCert makes every client prove possession of
	// a key (TLS 1.3 CertificateVerify) without checking a chain (our
	// certificates are self-signed); the fingerprint is then looked up in
	// the member set right after the handshake.
	t.serverTLS = &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cfg.Identity.Cert},
		ClientAuth:   tls.RequireAnyClientCert,
		NextProtos:   []string{peerALPN},
	}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	if cfg.Listen != "" {
		ln, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			t.cancel()
			return nil, fmt.Errorf("replication: peer listener: %w", err)
		}
		t.ln = ln
	}
	t.SetPeers(cfg.Peers)
	return t, nil
}

// Start accepts connections and dials the members. Calling it again, or
// after Close, does nothing.
func (t *PeerTransport) Start() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.started || t.closed {
		return
	}
	t.started = true
	t.goLocked(t.notifyLoop)
	if t.ln != nil {
		t.goLocked(t.acceptLoop)
	}
	for _, p := range t.peers {
		t.goLocked(func() { t.dialLoop(p) })
	}
}

// Close stops everything and waits for every goroutine, OnRequest and
// OnStranger handlers included. Later calls wait for the first to finish.
func (t *PeerTransport) Close() {
	t.closeOnce.Do(func() {
		t.mu.Lock()
		t.closed = true
		t.cancel()
		if t.ln != nil {
			t.ln.Close()
		}
		for nc := range t.live {
			nc.Close()
		}
		for _, p := range t.peers {
			p.shut()
		}
		t.mu.Unlock()
		t.wg.Wait()
	})
}

// Addr is the listener's address (nil without one); tests listen on :0.
func (t *PeerTransport) Addr() net.Addr {
	if t.ln == nil {
		return nil
	}
	return t.ln.Addr()
}

// Reachable reports whether a link to member id is up.
func (t *PeerTransport) Reachable(id uint64) bool {
	t.mu.RLock()
	p := t.peers[id]
	t.mu.RUnlock()
	return p != nil && p.pick() != nil
}

// Stats returns the counters.
func (t *PeerTransport) Stats() TransportStats {
	s := &t.stats
	st := TransportStats{
		FramesSent: s.framesSent.Load(), FramesReceived: s.framesRecv.Load(),
		BytesSent: s.bytesSent.Load(), BytesReceived: s.bytesRecv.Load(),
		MsgsSent: s.msgsSent.Load(), MsgsReceived: s.msgsRecv.Load(),
		Dropped: s.dropped.Load(), Refused: s.refused.Load(), Knocks: s.knocks.Load(),
	}
	for i := range st.StrangerRefusals {
		st.StrangerRefusals[i] = s.strangers[i].Load()
	}
	return st
}

// SetPeers replaces the member set. Links to removed members, or to a
// member whose fingerprint changed, close; a member whose addresses changed
// is redialled at the new ones if its link used an address no longer
// listed; every member without a link is dialled now, with a fresh backoff
// (so SetPeers also means "try again now"). Entries for this node or id 0
// are ignored.
func (t *PeerTransport) SetPeers(peers []PeerInfo) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	want := make(map[uint64]PeerInfo, len(peers))
	for _, pi := range peers {
		if pi.ID != 0 && pi.ID != t.id {
			want[pi.ID] = pi
		}
	}
	for id, p := range t.peers {
		if pi, ok := want[id]; !ok || pi.Fingerprint != p.fp {
			p.shut()
			delete(t.peers, id)
			delete(t.byFP, p.fp)
		}
	}
	for h, id := range t.seenHosts {
		if _, ok := want[id]; !ok {
			delete(t.seenHosts, h)
		}
	}
	for id, pi := range want {
		if p := t.peers[id]; p != nil {
			p.setAddrs(pi.Addrs)
			continue
		}
		if other := t.byFP[pi.Fingerprint]; other != nil {
			t.log.Error("two members share a fingerprint; ignoring the second", "peer", IDString(id), "other", IDString(other.id))
			continue
		}
		p := &peer{id: id, fp: pi.Fingerprint, addrs: slices.Clone(pi.Addrs), wake: make(chan struct{}, 1), upc: make(chan struct{})}
		p.ctx, p.cancel = context.WithCancel(t.ctx)
		t.peers[id], t.byFP[p.fp] = p, p
		if t.started {
			t.goLocked(func() { t.dialLoop(p) })
		}
	}
}

// Reconnect closes every member link; each is made again with a fresh
// handshake. Call it after changing this node's generation or cluster id,
// so that no link carries raft on the strength of an old hello.
func (t *PeerTransport) Reconnect() {
	t.mu.RLock()
	defer t.mu.RUnlock()
	for _, p := range t.peers {
		for _, c := range []*conn{p.out.Load(), p.in.Load()} {
			if c != nil {
				c.close(errors.New("reconnect requested"))
			}
		}
		p.kick()
	}
}

// Send queues msgs for their peers and returns at once; see the type's doc
// for the drop policy. Entry data is held, not copied, until written.
func (t *PeerTransport) Send(msgs []pb.Message) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	for i := range msgs {
		m := &msgs[i]
		if m.To == t.id || m.To == 0 {
			continue // raft never addresses these to the network
		}
		p := t.peers[m.To]
		if t.closed || p == nil {
			t.drop(m, "not a member")
			continue
		}
		size := m.Size()
		if size > maxRaftMsgSize {
			t.log.Error("raft message too large for a frame; dropped", "peer", IDString(m.To), "type", m.Type, "bytes", size)
			t.drop(m, "too large")
			continue
		}
		c := p.pick()
		if c == nil {
			t.drop(m, "peer down")
		} else if !c.enqueueRaft(*m, size) {
			t.drop(m, "send queue full")
		}
	}
}

func (t *PeerTransport) drop(m *pb.Message, why string) {
	t.stats.dropped.Add(1)
	t.logLimited("drop|"+IDString(m.To)+"|"+why, slog.LevelDebug, "raft messages dropped", "peer", IDString(m.To), "reason", why)
	if t.closed {
		return
	}
	t.noteUnreachable(m.To)
	if m.Type == pb.MsgSnap {
		t.noteSnapshot(m.To, false)
	}
}

// Request sends a request of kind to member to and waits for its answer or
// ctx. Many may be in flight on one link; the peer's handler sees ctx's
// deadline. While the peer has no link, Request waits for one until ctx
// ends (the error then wraps both ctx's error and ErrPeerUnreachable).
// A handler's error crosses as text wrapped in ErrRemote: outcomes the
// caller must tell apart (ErrNotLeader, ErrAckTimeout) belong in the reply.
func (t *PeerTransport) Request(ctx context.Context, to uint64, kind byte, payload []byte) ([]byte, error) {
	if len(payload) > MaxFrameSize-14 {
		return nil, fmt.Errorf("%w (%w): request of %d bytes", ErrFrameTooLarge, ErrNotSent, len(payload))
	}
	for {
		t.mu.RLock()
		p, closed := t.peers[to], t.closed
		t.mu.RUnlock()
		switch {
		case closed:
			return nil, fmt.Errorf("%w (%w)", ErrTransportClosed, ErrNotSent)
		case p == nil:
			return nil, fmt.Errorf("%w (%w): %s", ErrPeerUnknown, ErrNotSent, IDString(to))
		}
		c, upc := p.conn()
		var up <-chan time.Time
		if c != nil {
			reply, err := c.request(ctx, kind, payload)
			if !errors.Is(err, errConnClosed) {
				return reply, err
			}
			// Closed before the request was queued, so it is safe to
			// resend: wait for the link to be replaced.
			up = time.After(minBackoff)
		}
		select {
		case <-upc:
		case <-up:
		case <-p.ctx.Done(): // removed, replaced or closed: look again
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (%w, %w: no link to %s)", ctx.Err(), ErrPeerUnreachable, ErrNotSent, IDString(to))
		}
	}
}

// goLocked starts f as a tracked goroutine; t.mu is held and t.closed is
// false, so no Add can race with Close's Wait.
func (t *PeerTransport) goLocked(f func()) {
	t.wg.Add(1)
	go func() { defer t.wg.Done(); f() }()
}

// goChild starts f from a goroutine that is itself tracked: the counter is
// above zero, so Add is safe even while Close waits.
func (t *PeerTransport) goChild(f func()) {
	t.wg.Add(1)
	go func() { defer t.wg.Done(); f() }()
}

func (t *PeerTransport) track(nc net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.live[nc] = struct{}{}
	return true
}

func (t *PeerTransport) untrack(nc net.Conn) {
	t.mu.Lock()
	delete(t.live, nc)
	t.mu.Unlock()
	nc.Close()
}

func (t *PeerTransport) logLimited(key string, level slog.Level, msg string, args ...any) {
	if !t.log.Enabled(context.Background(), level) {
		return
	}
	now := time.Now()
	t.logMu.Lock()
	if last, ok := t.logged[key]; ok && now.Sub(last) < logEvery {
		t.logMu.Unlock()
		return
	}
	if len(t.logged) >= 1024 { // bound the memory a scan of many addresses costs
		for k, at := range t.logged {
			if now.Sub(at) >= logEvery {
				delete(t.logged, k)
			}
		}
		if len(t.logged) >= 1024 {
			clear(t.logged)
		}
	}
	t.logged[key] = now
	t.logMu.Unlock()
	t.log.Log(context.Background(), level, msg, args...)
}

func (t *PeerTransport) noteUnreachable(id uint64) {
	t.notesMu.Lock()
	t.unreach[id] = struct{}{}
	t.notesMu.Unlock()
	signal(t.notesSig)
}

func (t *PeerTransport) noteSnapshot(to uint64, ok bool) {
	t.notesMu.Lock()
	t.snaps = append(t.snaps, snapNote{to, ok})
	t.notesMu.Unlock()
	signal(t.notesSig)
}

// notifyLoop calls OnUnreachable and OnSnapshot off the goroutines that
// noticed, so Send (called on the raft goroutine) never calls back into raft,
// and a burst of drops to one peer becomes one report.
func (t *PeerTransport) notifyLoop() {
	for {
		select {
		case <-t.ctx.Done():
			return
		case <-t.notesSig:
		}
		t.notesMu.Lock()
		ids, snaps := make([]uint64, 0, len(t.unreach)), t.snaps
		for id := range t.unreach {
			ids = append(ids, id)
		}
		clear(t.unreach)
		t.snaps = nil
		t.notesMu.Unlock()
		for _, id := range ids {
			t.cfg.OnUnreachable(id)
		}
		for _, s := range snaps {
			t.cfg.OnSnapshot(s.to, s.ok)
		}
	}
}

// signal wakes whoever waits on ch (capacity 1) without blocking.
func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func jitter(d time.Duration) time.Duration { return d/2 + rand.N(d/2+1) }

// peer is one member: its pinned fingerprint, its addresses and its links.
type peer struct {
	id     uint64
	fp     [32]byte
	ctx    context.Context // cancelled when the peer is removed or the transport closes
	cancel context.CancelFunc
	wake   chan struct{}        // capacity 1: dial now, with a fresh backoff
	out    atomic.Pointer[conn] // the link this node dialled
	in     atomic.Pointer[conn] // the newest link the peer dialled

	mu      sync.Mutex // guards addrs, upc, up and stopped
	addrs   []string
	upc     chan struct{} // closed while the peer has a link
	up      bool
	stopped bool
}

// pick returns the link to send on: our own, else the peer's.
func (p *peer) pick() *conn {
	if c := p.out.Load(); c != nil {
		return c
	}
	return p.in.Load()
}

// conn returns the link to send on or, without one, a channel closed when
// one comes up.
func (p *peer) conn() (*conn, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c := p.pick(); c != nil {
		return c, nil
	}
	return nil, p.upc
}

// attach makes c the link in slot, returning the one it replaces; false if
// the peer was removed meanwhile.
func (p *peer) attach(slot *atomic.Pointer[conn], c *conn) (*conn, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return nil, false
	}
	old := slot.Swap(c)
	p.updateLocked()
	return old, true
}

func (p *peer) detach(slot *atomic.Pointer[conn], c *conn) {
	p.mu.Lock()
	slot.CompareAndSwap(c, nil)
	p.updateLocked()
	p.mu.Unlock()
}

func (p *peer) updateLocked() {
	up := p.pick() != nil
	if up && !p.up {
		close(p.upc)
	} else if !up && p.up {
		p.upc = make(chan struct{})
	}
	p.up = up
}

// shut stops the peer's dialling and closes its links.
func (p *peer) shut() {
	p.mu.Lock()
	p.stopped = true
	p.mu.Unlock()
	p.cancel()
	for _, c := range []*conn{p.out.Load(), p.in.Load()} {
		if c != nil {
			c.close(ErrPeerUnknown)
		}
	}
}

// setAddrs updates the addresses, drops our link if it used one no longer
// listed, and dials at once if there is no link.
func (p *peer) setAddrs(addrs []string) {
	p.mu.Lock()
	p.addrs = slices.Clone(addrs)
	p.mu.Unlock()
	out := p.out.Load()
	if out != nil && !slices.Contains(addrs, out.addr) {
		out.close(errors.New("peer address changed"))
		out = nil
	}
	if out == nil {
		p.kick()
	}
}

func (p *peer) kick() { signal(p.wake) }

func (p *peer) addr(i int) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.addrs) == 0 {
		return ""
	}
	return p.addrs[i%len(p.addrs)]
}

// dialLoop keeps a link to p: dial its addresses in turn, run the link
// until it fails, wait an exponential backoff with jitter (50 ms → 5 s),
// again. SetPeers and Reconnect cut the wait short.
func (t *PeerTransport) dialLoop(p *peer) {
	backoff, idx, failing := minBackoff, 0, false
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		hasAddr := false
		if addr := p.addr(idx); addr != "" {
			hasAddr = true
			start := time.Now()
			c, err := t.dialPeer(p, addr)
			switch {
			case err == nil:
				failing = false
				t.runConn(c, p, &p.out)
				if time.Since(start) >= stableAfter {
					backoff = minBackoff
				}
			case p.ctx.Err() != nil:
				return
			default:
				idx++
				level := slog.LevelDebug
				if !failing {
					level = slog.LevelInfo // the first failure of a streak
				}
				failing = true
				t.log.Log(p.ctx, level, "cannot reach peer; retrying", "peer", IDString(p.id), "addr", addr, "error", err)
			}
		}
		var wait <-chan time.Time
		if hasAddr {
			timer.Reset(jitter(backoff))
			wait = timer.C
		}
		select {
		case <-p.ctx.Done():
			return
		case <-p.wake:
			backoff, idx = minBackoff, 0
		case <-wait:
			backoff = min(2*backoff, maxBackoff)
		}
	}
}
