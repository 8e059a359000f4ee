package replication

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// AckMode is a topic's acknowledgement rule.
type AckMode uint8

const (
	// Async: acked once the master has the record on disk.
	Async AckMode = iota
	// Sync: acked once the master and at least MinSyncReplicas other
	// members have the record on disk.
	Sync
)

// String returns "async" or "sync".
func (m AckMode) String() string {
	if m == Sync {
		return "sync"
	}
	return "async"
}

// Applier receives committed records in log order, on one goroutine of its
// own (never the raft loop). An error stops the node: the log can no longer
// be applied in order.
type Applier interface {
	// Apply is given a record as storage.AppendRecord encoded it; data is
	// only valid during the call. The applier decodes what it needs
	// (storage.RecordTopic, storage.DecodeRecord): most records on a
	// gateway have no local subscriber, and need no full decode.
	Apply(index uint64, data []byte) error
}

// Transport carries raft messages to peers. Send must not block on a slow
// peer. A nil Transport means a single-node group.
type Transport interface {
	Send(msgs []pb.Message)
}

// Config configures a Node. Zero fields take the defaults of DefaultConfig.
type Config struct {
	// Identity is this node's key pair and id (required).
	Identity *Identity
	// Storage is the opened data file (required). The Node owns its writes.
	Storage *storage.DB
	// Applier receives committed records (required).
	Applier Applier
	// Transport sends raft messages to peers; nil for a lone gateway.
	Transport Transport
	// Logger receives the node's and raft's messages; nil discards them.
	// The node adds component=replication to its own lines and
	// component=raft to raft's: give it a logger without a component, or
	// a line carries two.
	Logger *slog.Logger
	// Heartbeat is the raft tick: leaders heartbeat once per tick.
	Heartbeat time.Duration
	// ElectionTimeout is how long a follower waits for a leader before it
	// campaigns; a whole number of heartbeats, at least two.
	ElectionTimeout time.Duration
	// SyncTimeout bounds how long a proposal may wait for its ack rule.
	SyncTimeout time.Duration
	// MinSyncReplicas is how many members besides the master must hold a
	// record before a sync topic acks it.
	MinSyncReplicas int
	// MemberContext is stored with this node's membership entry when a new
	// group is bootstrapped (name, addresses, fingerprint).
	MemberContext []byte
	// Join starts a fresh data dir as a member-to-be of an existing
	// cluster: no bootstrap, no campaign; the master's log (from index 1,
	// membership included) brings it up to date once it adds this node.
	Join bool
	// InitialMembers, if set, is the membership a fresh data dir starts
	// with (it must include this node); by default a group of this node
	// alone. Tests build clusters this way; gateways join by conf change.
	InitialMembers []raft.Peer
	// OnMembership, if set, is called with the whole membership whenever a
	// change to it is applied (on the raft goroutine: it must not block).
	OnMembership func([]Member)
	// Forwarder, if set, carries proposals made while another node is the
	// master to that master. Without it they fail with ErrNotLeader.
	Forwarder Forwarder
	// CatchUpTo, if set, is the master's commit index when this node
	// joined: until it has applied that far, the membership it applies is
	// an old one (in which it may even have been the only voter, for a
	// deposed master rejoining), so it never campaigns meanwhile.
	CatchUpTo uint64
	// Admit, if set, is asked on the master about each record a slave
	// forwards before it is proposed: an error refuses it, sent back as
	// its outcome (wrap ErrStorage for a lack of room, which devices get
	// as 0x97). The master's own publishes are checked where they are
	// taken, before Propose.
	Admit func(data []byte) error
	// PastBudget, if set, says whether the master takes a record, its own
	// or forwarded, while its log is over its budget (storage's
	// Refusing), where every publish is refused: a record a device cannot
	// be served without that is small and few, such as a resumed
	// session's start record (one per CONNECT, which the connect rate
	// bounds), so that subscribers keep being served (DESIGN.md).
	PastBudget func(data []byte) bool
	// Backfill, if set, carries the requests of a member that installed
	// a snapshot for the records before it (backfill.go).
	Backfill Backfiller
	// SilentMemberHold is how long a member that stopped answering still
	// holds retention on the master: past it, the oldest records it lacks
	// may go, and it installs a snapshot when it returns. Zero means ten
	// election timeouts.
	SilentMemberHold time.Duration
	// AfterResolve, if set, is called after each run of proposal
	// callbacks, so their effects (acks) can be batched: on the raft
	// goroutine, or on Propose's caller when it refuses at once. It must
	// not block and must be safe for concurrent calls.
	AfterResolve func()

	// ticks, set by this package's tests only, replaces the Heartbeat
	// ticker: each receive is one raft tick, so time is logical and a
	// seeded test replays exactly (etcd raft's own tests tick by hand).
	ticks <-chan struct{}
	// snapChunk and snapEvery, set by tests only, replace the size of a
	// snapshot pull's chunk and the least time between two (snappull.go).
	snapChunk int
	snapEvery time.Duration
	// afterTurn, set by tests only, runs at the end of every turn of the
	// raft loop: the turn a delivered message, a tick or a proposal
	// caused is over, and what it sent is with the Transport.
	afterTurn func()
	// sendAtOnce, set by tests only, sends every message when raft hands
	// it over (commitsend.go): the exact-replay harness must see no turn
	// it did not cause, which a hold's wall-clock timer would make.
	sendAtOnce bool
}

// DefaultConfig returns the defaults of DESIGN.md.
func DefaultConfig() Config {
	return Config{Heartbeat: 100 * time.Millisecond, ElectionTimeout: time.Second, SyncTimeout: 5 * time.Second, MinSyncReplicas: 1}
}

// validate checks c and fills defaults.
func (c *Config) validate() error {
	d := DefaultConfig()
	if c.Identity == nil || c.Storage == nil || c.Applier == nil {
		return errors.New("replication: Identity, Storage and Applier are required")
	}
	if c.Logger == nil {
		c.Logger = discard()
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = d.Heartbeat
	}
	if c.ElectionTimeout == 0 {
		c.ElectionTimeout = d.ElectionTimeout
	}
	if c.SyncTimeout == 0 {
		c.SyncTimeout = d.SyncTimeout
	}
	if c.MinSyncReplicas == 0 {
		c.MinSyncReplicas = d.MinSyncReplicas
	}
	if c.ElectionTimeout < 2*c.Heartbeat {
		return fmt.Errorf("replication: election timeout %v must be at least two heartbeats (%v)", c.ElectionTimeout, c.Heartbeat)
	}
	return nil
}

// Node is one member of a raft group of gateways. One goroutine (run) owns
// the RawNode, the log's write order and every proposal; others reach it
// through the proposal queue, recvc and the status request channel.
type Node struct {
	cfg Config
	id  uint64
	db  *storage.DB
	rn  *raft.RawNode
	log *slog.Logger

	// level is the cluster's feature level as applied here (feature.go);
	// builds is the transport as PeerBuilds (nil without one) and raiseAt
	// when the loop next looks whether it may raise the level.
	level   atomic.Int32
	builds  PeerBuilds
	raiseAt time.Time
	// extras is what a build's levels above the release's need kept
	// (feature_default.go, feature_next.go).
	extras levelExtras

	// propMu guards propQ, the proposals not yet taken by the loop; propSig
	// wakes the loop. A mutex-guarded slice costs one lock per publish and
	// lets the loop take a whole burst at once.
	propMu sync.Mutex
	propQ  []*proposal
	// propSpare is the array of the last propQ the loop took, emptied,
	// for propQ to start again in (instead of growing a new one from nil
	// at every take); nil while propQ is in it.
	propSpare []*proposal
	closedErr error // set when the loop has exited: proposals fail at once
	propSig   chan struct{}
	// batch decides when the loop takes propQ (group commit).
	batch groupCommit

	recvc    chan pb.Message
	unreachc chan struct{}
	// unreachMu guards unreach, the peers reported unreachable since the
	// raft goroutine last looked.
	unreachMu sync.Mutex
	unreach   map[uint64]bool
	confc     chan confReq
	// requeueSig wakes requeueLoop after a save moved entries aside.
	requeueSig    chan struct{}
	requeuedTotal atomic.Uint64
	// refusedSkipped counts requeued records dropped, not re-published,
	// because their sync publishers were refused (requeue.go).
	refusedSkipped atomic.Uint64
	// settlesSkipped counts requeued settlement records dropped: they
	// named indexes of the log they were cut from (requeue.go).
	settlesSkipped atomic.Uint64

	// membersMu guards members: the cluster's details, kept in memory
	// because staged writes are not readable before their commit.
	membersMu sync.Mutex
	members   map[uint64]Member
	statusc   chan chan Status
	stopc     chan struct{}
	stopOnce  sync.Once
	wg        sync.WaitGroup
	applyc    chan []pb.Entry
	failed    atomic.Pointer[error] // sticky: set when the log can no longer be written or applied
	failc     chan struct{}         // closed when failed is set
	failOnce  sync.Once

	seq     atomic.Uint64         // next record sequence number
	diskErr atomic.Pointer[error] // set while saving the log fails
	// saveFault is the tests' failpoint: while set, every save of the
	// log fails with it, as a failing disk's would. Never set in
	// production.
	saveFault atomic.Pointer[error]
	lead      atomic.Uint64 // the leader raft last reported, 0 for none
	// leaderChanges counts changes of lead, for metrics.
	leaderChanges atomic.Uint64
	term          atomic.Uint64 // the term last saved
	catchUp       atomic.Uint64 // Config.CatchUpTo until applied that far, then 0
	// floor is the highest index retention may drop (updateFloor).
	floor atomic.Uint64
	// fenced is set by Fence: this node learned that another was promoted
	// over it, and takes no more proposals (promote.go).
	fenced atomic.Bool
	// handoff hands the mastership over while this node cannot write
	// (handoff.go).
	handoff handoff
	// cutOff is when this master found itself cut off from the majority
	// (clock.Mono; 0 while it is not); heard is the tick at which
	// each peer was last heard from, ticks counts the loop's ticks (both
	// loop-owned): handoff.go.
	cutOff atomic.Int64
	heard  map[uint64]uint64
	ticks  uint64
	// campaignNext: stand for election after this Ready (apply.go);
	// loop-owned.
	campaignNext bool
	// masterSilent is set while the master this node knows (another
	// one) has sent it nothing for an election timeout (cutoff.go).
	masterSilent atomic.Bool

	// fwd is the forward stream (forward.go); inMu guards inboundBy, the
	// order of each peer's stream on this node as master.
	fwd       fwdStream
	inMu      sync.Mutex
	inboundBy map[uint64]*fwdInbound

	// Loop-owned state.
	pending    int                 // proposals in live that raft has taken and not saved (proposal.pending)
	live       map[recID]*proposal // proposed here and unresolved, by record id
	logged     recentLogged        // where recently saved records are, by id
	syncWait   []*proposal         // saved, sync mode, waiting for replicas; by index
	byDue      []*proposal         // every unresolved proposal, by deadline
	leader     bool
	confSeq    uint64        // ids of the conf changes this node proposed
	confWait   []*confWaiter // conf changes proposed here, not yet applied
	savedHS    pb.HardState  // the last hard state written by Save
	incomplete incompleteState
	// skippedIncomplete counts the committed entries the apply
	// goroutine passed over while the state was incomplete (incomplete.go).
	skippedIncomplete atomic.Uint64
	flushFailed       time.Time // when tick's Flush of staged metadata last failed; zero when it works
	resolvedSome      bool      // callbacks ran since the last flushResolved
	settle            settler   // the outcomes of sync records, as master (settle.go)
	// held is, per member, the commit-only append held back since
	// heldSince (commitsend.go).
	held      map[uint64]pb.Message
	heldSince time.Time
	heldT     *time.Timer // ends a hold (heldWake)
	// lastAppend and prevAppend are when the last two appends with
	// records went out, as master (commitsend.go).
	lastAppend, prevAppend time.Time

	// silentSince is the tick from which each other member's silence is
	// counted while this node is master, if it was never heard since
	// (silentMembers); cleared when it stops leading. installing is the
	// snapshot handed to the apply goroutine (installSnapshot), written
	// before the send on applyc, read after.
	silentSince map[uint64]uint64
	installing  *snapInstall
	bf          backfillProgress // the catch-up after a snapshot (backfill.go)
	// pull takes snapshots sent by reference to the pull loop; serve and
	// snapWait (loop-owned: the tick since which raft waits for each
	// member's snapshot) watch the pulls as master (snappull.go).
	pull     snapPuller
	serve    snapServer
	snapWait map[uint64]uint64
}

// NewNode opens the raft group stored in cfg.Storage, bootstrapping a
// single-voter group on an empty file.
func NewNode(cfg Config) (*Node, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	db := cfg.Storage
	id := cfg.Identity.ID
	switch stored := db.NodeID(); {
	case stored == 0:
		if err := db.SetNodeID(id); err != nil {
			return nil, err
		}
	case stored != id:
		return nil, fmt.Errorf("data file %s was written by node %s, this node's key is %s: %w", db.Path(), IDString(stored), IDString(id), ErrIdentity)
	}
	db.DropSnapshotFiles() // an earlier run's: none is in use yet
	epoch, err := db.NextEpoch()
	if err != nil {
		return nil, err
	}
	n := &Node{
		cfg:        cfg,
		id:         id,
		db:         db,
		log:        cfg.Logger.With("component", "replication"),
		propSig:    make(chan struct{}, 1),
		recvc:      make(chan pb.Message, 256),
		unreachc:   make(chan struct{}, 1),
		unreach:    map[uint64]bool{},
		confc:      make(chan confReq),
		requeueSig: make(chan struct{}, 1),
		statusc:    make(chan chan Status),
		stopc:      make(chan struct{}),
		applyc:     make(chan []pb.Entry, 64),
		failc:      make(chan struct{}),
		live:       map[recID]*proposal{},
		inboundBy:  map[uint64]*fwdInbound{},
	}
	n.fwd.sig = make(chan struct{}, 1)
	n.pull.sig, n.pull.stepped = make(chan struct{}, 1), make(chan struct{}, 1)
	n.pull.pulling.Store(-1)
	if cfg.Transport != nil {
		n.builds, _ = cfg.Transport.(PeerBuilds)
		n.cfg.Transport = tagTransport{inner: cfg.Transport, n: n}
	}
	db.SnapshotBucket(storage.BucketFeature, nil)
	n.level.Store(int32(db.FeatureLevelOf()))
	if err := n.loadMembers(); err != nil {
		return nil, err
	}
	n.seq.Store(epoch << 32)
	n.catchUp.Store(cfg.CatchUpTo)
	n.confSeq = epoch << 32 // conf change ids of this run never match an earlier run's
	rcfg := &raft.Config{
		ID:              id,
		ElectionTick:    int(cfg.ElectionTimeout / cfg.Heartbeat),
		HeartbeatTick:   1,
		Storage:         db,
		Applied:         db.Applied(),
		MaxSizePerMsg:   1 << 20,
		MaxInflightMsgs: 256,
		CheckQuorum:     true,
		PreVote:         true,
		Logger:          newRaftLogger(cfg.Logger.With("component", "raft")),
	}
	rn, err := raft.NewRawNode(rcfg)
	if err != nil {
		return nil, fmt.Errorf("replication: %w", err)
	}
	n.rn = rn
	n.savedHS = db.HardState()
	n.term.Store(n.savedHS.Term)
	last, _ := db.LastIndex()
	if last == 0 && raft.IsEmptyHardState(db.HardState()) && !cfg.Join {
		members := cfg.InitialMembers
		if len(members) == 0 {
			members = []raft.Peer{{ID: id, Context: cfg.MemberContext}}
		}
		if err := rn.Bootstrap(members); err != nil {
			return nil, fmt.Errorf("replication: bootstrap: %w", err)
		}
		n.log.Info("new group", "id", IDString(id), "members", len(members))
		// Persist and apply the bootstrap entries now: raft refuses to
		// campaign while a configuration change is pending.
		for rn.HasReady() {
			if !n.handleReady() {
				return nil, n.errOr(ErrStopped)
			}
		}
	}
	if cs := rn.Status().Config.Voters.IDs(); len(cs) == 1 && !n.catchingUp() {
		if _, ok := cs[id]; !ok {
			goto start
		}
		// A lone voter need not wait an election timeout to lead.
		if err := rn.Campaign(); err != nil {
			return nil, fmt.Errorf("replication: campaign: %w", err)
		}
	}
start:
	n.goFunc(n.run)
	n.goFunc(n.applyLoop)
	n.goFunc(n.requeueLoop)
	if cfg.Forwarder != nil {
		n.goFunc(n.forwardLoop)
	}
	if cfg.Backfill != nil {
		n.goFunc(n.backfillLoop)
		n.goFunc(n.snapPullLoop)
	}
	return n, nil
}

// goFunc runs f on a goroutine that Stop waits for. Callers are NewNode
// (before Stop can run) or goroutines goFunc started, whose own count keeps
// the WaitGroup above zero, so no Add races with Stop's Wait.
func (n *Node) goFunc(f func()) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		f()
	}()
}

// ID returns this node's id.
func (n *Node) ID() uint64 { return n.id }

// NextSeq returns a fresh sequence number for a record originating here.
func (n *Node) NextSeq() uint64 { return n.seq.Add(1) }

// Step hands a raft message from a peer to the raft goroutine. It blocks
// while the node is busy (back-pressure on the peer's connection) and drops
// the message once the node has stopped.
func (n *Node) Step(m pb.Message) {
	n.noteDiskTag(&m)
	select {
	case n.recvc <- m:
	case <-n.stopc:
	case <-n.failc:
	}
}

// ReportUnreachable tells raft that messages to id could not be sent, so it
// stops pipelining to it until it answers again. Reports are merged per
// peer, never lost for one peer because another's is pending.
func (n *Node) ReportUnreachable(id uint64) {
	n.unreachMu.Lock()
	n.unreach[id] = true
	n.unreachMu.Unlock()
	select {
	case n.unreachc <- struct{}{}:
	default: // a wake-up is pending: it takes the whole set
	}
}

// Err returns the sticky error that stopped the node, or nil.
func (n *Node) Err() error {
	if e := n.failed.Load(); e != nil {
		return *e
	}
	return nil
}

// Failed is closed when the node stops because of a storage or apply failure.
func (n *Node) Failed() <-chan struct{} { return n.failc }

// Stop stops the node: unresolved proposals get ErrStopped, the apply loop
// drains what was committed, staged metadata is flushed. The caller closes
// the storage afterwards.
func (n *Node) Stop() {
	n.stopOnce.Do(func() { close(n.stopc) })
	n.wg.Wait()
	if err := n.db.Flush(); err != nil && !errors.Is(err, storage.ErrClosed) {
		n.log.Warn("staged metadata (applied index, sessions) could not be written at stop; the next start goes on from the last state written, so a session may get some messages again", "error", err)
	}
}

func (n *Node) fail(err error) {
	n.failOnce.Do(func() {
		n.failed.Store(&err)
		n.log.Error("replication stopped", "error", err)
		close(n.failc)
	})
}

// run is the raft loop: tick, take proposals and messages, then handle every
// Ready in raft's order: persist → send → apply → Advance.
func (n *Node) run() {
	defer close(n.applyc)
	var wallTicks <-chan time.Time // nil with logical ticks (cfg.ticks)
	if n.cfg.ticks == nil {
		ticker := time.NewTicker(n.cfg.Heartbeat)
		defer ticker.Stop()
		wallTicks = ticker.C
	}
	due := time.NewTimer(time.Hour)
	defer due.Stop()
	var dueAt time.Time
	// A Ready may be waiting before the first event (the campaign of a
	// lone voter at start): the wake-up below handles it at once.
	wake := make(chan struct{}, 1)
	wake <- struct{}{}
	for {
		select {
		case <-wake:
		case <-wallTicks:
			n.tick()
		case <-n.cfg.ticks:
			n.tick()
		case <-n.propSig:
			n.proposeQueued()
		case m := <-n.recvc:
			n.stepPeer(m)
			// What else has arrived is stepped before this turn's
			// Ready: the messages of one frame (an append and the
			// commit index that follows it, the members' answers to
			// one append) then cost one Ready, one fsync and one
			// answer between them instead of one each. At most what
			// recvc holds, so a stream of messages cannot hold the
			// Ready off, and entries of one append's size at most
			// (MaxSizePerMsg): appends of 1 MB records drained whole
			// made one Ready, and one WAL frame, of tens of MB, which
			// took a slave's WAL to 24 MB and its RSS past its budget.
			stepped := entryBytes(m)
			for more := cap(n.recvc); more > 0 && stepped < drainBytes; more-- {
				select {
				case m := <-n.recvc:
					n.stepPeer(m)
					stepped += entryBytes(m)
					continue
				default:
				}
				break
			}
		case <-n.unreachc:
			n.unreachMu.Lock()
			for id := range n.unreach {
				n.rn.ReportUnreachable(id)
			}
			clear(n.unreach)
			n.unreachMu.Unlock()
		case req := <-n.confc:
			n.proposeConfChange(req)
		case ch := <-n.statusc:
			ch <- n.status()
		case <-due.C:
			dueAt = time.Time{}
		case <-n.settleWake():
		case <-n.heldWake():
		case <-n.failc:
			n.resolveAll(n.Err())
			return
		case <-n.stopc:
			n.resolveAll(ErrStopped)
			return
		}
		for n.rn.HasReady() {
			if !n.handleReady() {
				n.resolveAll(n.errOr(ErrStopped))
				return
			}
		}
		n.stepDone()
		now := time.Now()
		n.expire(now)
		n.settleTurn(now)
		n.flushResolved()
		n.releaseHeld(now)
		if len(n.byDue) > 0 && !n.byDue[0].deadline.Equal(dueAt) {
			dueAt = n.byDue[0].deadline
			due.Reset(time.Until(dueAt))
		}
		if n.cfg.afterTurn != nil {
			n.cfg.afterTurn()
		}
	}
}

// drainBytes bounds the entries the raft loop steps from peers before it
// handles the Ready: an append's worth (Config.MaxSizePerMsg).
const drainBytes = 1 << 20

// entryBytes is the size of the entries m carries.
func entryBytes(m pb.Message) int {
	n := 0
	for i := range m.Entries {
		n += len(m.Entries[i].Data)
	}
	return n
}

// stepPeer steps one message from a peer.
func (n *Node) stepPeer(m pb.Message) {
	n.noteHeard(m.From)
	if n.pullInstead(m) {
		return // a snapshot to pull first (snappull.go)
	}
	if n.refuseForSnapshot(m) {
		return // this member's state is incomplete (incomplete.go)
	}
	n.noteSnapshotAsked(&m)
	_ = n.rn.Step(m)
	if m.Type == pb.MsgAppResp {
		// A learner's ack moves no commit index, so no Ready follows
		// it: the sync records it covers are acked here, not at the
		// next heartbeat.
		n.checkSync()
	}
}

// tick is one heartbeat of the raft loop.
func (n *Node) tick() {
	if !n.catchingUp() {
		// A follower's ticks only time elections: one that is still
		// replaying history must not start any.
		n.rn.Tick()
	}
	now := time.Now()
	n.maybeHandOff(now)
	n.checkCutOff(now)
	if n.leader {
		n.watchSnapshots()
		n.maybeRaiseLevel(now)
		n.levelWork(now)
	}
	n.updateFloor()
	if n.db.Pending() && !n.rn.HasReady() && time.Since(n.flushFailed) >= time.Second {
		// Staged metadata (applied index, sessions) with no log traffic
		// to ride on: commit it on its own. A full disk fails it: the
		// stage keeps it and a later tick tries again, as a failing save
		// does, rather than stopping a gateway that still serves.
		switch err := n.db.Flush(); {
		case err != nil && !errors.Is(err, storage.ErrClosed):
			if n.flushFailed.IsZero() {
				n.log.Warn("writing staged metadata (applied index, sessions) failed; it stays staged and is retried every second", "error", err)
			}
			n.flushFailed = time.Now()
		case err == nil && !n.flushFailed.IsZero():
			n.log.Info("staged metadata written again")
			n.flushFailed = time.Time{}
		}
	}
}

func (n *Node) errOr(def error) error {
	if err := n.Err(); err != nil {
		return err
	}
	return def
}
