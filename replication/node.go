package replication

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"go.etcd.io/raft/v3/tracker"

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
	// AfterResolve, if set, is called after each run of proposal
	// callbacks, so their effects (acks) can be batched: on the raft
	// goroutine, or on Propose's caller when it refuses at once. It must
	// not block and must be safe for concurrent calls.
	AfterResolve func()
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

// recID is a record's id: origin node and sequence number.
type recID struct{ origin, seq uint64 }

// proposal is one record on its way to its ack rule. Loop-owned after
// Propose hands it over.
type proposal struct {
	id       recID
	data     []byte
	mode     AckMode
	done     func(index uint64, err error)
	deadline time.Time
	index    uint64
	resolved bool
	counted  bool // in batch.inNode: enqueued, not yet resolved
	// inbound marks a record a slave forwarded here: if this node is no
	// longer the master it is answered ErrNotLeader (the slave sends it
	// on), never put on this node's own stream.
	inbound bool
	// viaStream marks one of this node's records that reached its raft
	// queue through the forward stream: it may be in the log already
	// (logged by the previous master), so it is remembered like another
	// node's record.
	viaStream bool
	// stepped is set once raft took the record, here or (forwarded) on
	// the master: from then on it may be in the log, whatever its outcome.
	stepped bool
	also    []*proposal // later copies of the same record, sharing the outcome
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

	// propMu guards propQ, the proposals not yet taken by the loop; propSig
	// wakes the loop. A mutex-guarded slice costs one lock per publish and
	// lets the loop take a whole burst at once.
	propMu    sync.Mutex
	propQ     []*proposal
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
	lead    atomic.Uint64         // the leader raft last reported, 0 for none
	// leaderChanges counts changes of lead, for metrics.
	leaderChanges atomic.Uint64
	term          atomic.Uint64 // the term last saved
	catchUp       atomic.Uint64 // Config.CatchUpTo until applied that far, then 0
	// floor is the highest index retention may drop (updateFloor).
	floor atomic.Uint64
	// fenced is set by Fence: this node learned that another was promoted
	// over it, and takes no more proposals (promote.go).
	fenced atomic.Bool

	// fwd is the forward stream (forward.go); inMu guards inboundBy, the
	// order of each peer's stream on this node as master.
	fwd       fwdStream
	inMu      sync.Mutex
	inboundBy map[uint64]*fwdInbound

	// Loop-owned state.
	pending      map[recID]*proposal // proposed, not yet saved
	live         map[recID]*proposal // proposed here and unresolved, by record id
	logged       recentLogged        // where recently saved records are, by id
	syncWait     []*proposal         // saved, sync mode, waiting for replicas; by index
	byDue        []*proposal         // every unresolved proposal, by deadline
	leader       bool
	confSeq      uint64        // ids of the conf changes this node proposed
	confWait     []*confWaiter // conf changes proposed here, not yet applied
	savedHS      pb.HardState  // the last hard state written by Save
	resolvedSome bool          // callbacks ran since the last flushResolved
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
		pending:    map[recID]*proposal{},
		live:       map[recID]*proposal{},
		inboundBy:  map[uint64]*fwdInbound{},
	}
	n.fwd.sig = make(chan struct{}, 1)
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
	n.wg.Add(3)
	go n.run()
	go n.applyLoop()
	go n.requeueLoop()
	if cfg.Forwarder != nil {
		n.wg.Add(1)
		go n.forwardLoop()
	}
	return n, nil
}

// ID returns this node's id.
func (n *Node) ID() uint64 { return n.id }

// NextSeq returns a fresh sequence number for a record originating here.
func (n *Node) NextSeq() uint64 { return n.seq.Add(1) }

// Propose submits data, an encoded record, under mode's ack rule. done is
// called exactly once, on the replication goroutine, with the record's index
// when the rule is met, or with an error (ErrAckTimeout, ErrNotLeader,
// ErrStopped, ErrStorage) when it cannot be. done must not block.
func (n *Node) Propose(data []byte, mode AckMode, done func(index uint64, err error)) {
	origin, seq, err := storage.RecordID(data)
	if err != nil {
		n.refuseNow(done, fmt.Errorf("replication: propose: %w", err))
		return
	}
	p := &proposal{id: recID{origin, seq}, data: data, mode: mode, done: done, deadline: time.Now().Add(n.cfg.SyncTimeout)}
	// Another node is the master, or records taken before this one are
	// still on the forward stream: this one follows them there, so a
	// publisher's records keep their order (forward.go).
	if n.cfg.Forwarder != nil && n.fwdTake(p, n.Leader() != n.id) {
		return
	}
	n.enqueue(p)
}

// enqueue hands p to the raft goroutine, or fails it at once when the node
// cannot take proposals.
func (n *Node) enqueue(p *proposal) {
	if e := n.diskErr.Load(); e != nil {
		n.refuseNow(p.done, *e)
		return
	}
	if n.fenced.Load() {
		n.refuseNow(p.done, ErrNotLeader)
		return
	}
	if n.db.LowOnSpace() {
		// The filesystem is nearly full, whoever filled it: a write now
		// could fail halfway through a checkpoint.
		n.refuseNow(p.done, ErrDiskLow)
		return
	}
	if n.db.Refusing() {
		// Logging more would only grow the data dir past its budget:
		// devices get 0x97 quota exceeded until the member catches up.
		n.refuseNow(p.done, ErrLogFull)
		return
	}
	n.propMu.Lock()
	if n.closedErr != nil {
		err := n.closedErr
		n.propMu.Unlock()
		n.refuseNow(p.done, err)
		return
	}
	p.counted = true
	n.propQ = append(n.propQ, p)
	wake := n.batch.arrived(len(n.propQ))
	n.propMu.Unlock()
	if wake {
		n.wakeProposals()
	}
}

// wakeProposals makes the loop look at propQ.
func (n *Node) wakeProposals() {
	select {
	case n.propSig <- struct{}{}:
	default:
	}
}

// refuseNow fails a proposal on the caller's goroutine, then lets
// AfterResolve act on it as the raft goroutine would.
func (n *Node) refuseNow(done func(uint64, error), err error) {
	done(0, err)
	if n.cfg.AfterResolve != nil {
		n.cfg.AfterResolve()
	}
}

// Step hands a raft message from a peer to the raft goroutine. It blocks
// while the node is busy (back-pressure on the peer's connection) and drops
// the message once the node has stopped.
func (n *Node) Step(m pb.Message) {
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
		n.log.Error("flush at stop failed", "error", err)
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
	defer n.wg.Done()
	defer close(n.applyc)
	ticker := time.NewTicker(n.cfg.Heartbeat)
	defer ticker.Stop()
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
		case <-ticker.C:
			if !n.catchingUp() {
				// A follower's ticks only time elections: one that is
				// still replaying history must not start any.
				n.rn.Tick()
			}
			n.updateFloor()
			if n.db.Pending() && !n.rn.HasReady() {
				// Staged metadata (applied index, sessions) with no log
				// traffic to ride on: commit it on its own.
				if err := n.db.Flush(); err != nil {
					n.fail(fmt.Errorf("%w: %v", ErrStorage, err))
				}
			}
		case <-n.propSig:
			n.proposeQueued()
		case m := <-n.recvc:
			_ = n.rn.Step(m)
			if m.Type == pb.MsgAppResp {
				// A learner's ack moves no commit index, so no Ready
				// follows it: the sync records it covers are acked here,
				// not at the next heartbeat.
				n.checkSync()
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
		n.expire(time.Now())
		n.flushResolved()
		if len(n.byDue) > 0 && !n.byDue[0].deadline.Equal(dueAt) {
			dueAt = n.byDue[0].deadline
			due.Reset(time.Until(dueAt))
		}
	}
}

func (n *Node) errOr(def error) error {
	if err := n.Err(); err != nil {
		return err
	}
	return def
}

// proposeQueued hands the queued proposals to raft in one MsgProp.
func (n *Node) proposeQueued() {
	n.propMu.Lock()
	if len(n.propQ) == 0 || !n.batch.take(time.Now(), n.leader, n.wakeProposals) {
		n.propMu.Unlock()
		return
	}
	ps := n.propQ
	n.propQ = nil
	n.propMu.Unlock()
	if len(ps) == 0 {
		return
	}
	if !n.leader {
		var back []*proposal
		for _, p := range ps {
			if n.cfg.Forwarder == nil || p.inbound {
				n.resolve(p, ErrNotLeader)
				continue
			}
			// Taken here while this node was the master, never handed
			// to raft: it goes to the new master, ahead of what this
			// node took since.
			if p.counted {
				n.batch.left()
				p.counted = false
			}
			back = append(back, p)
		}
		if len(back) > 0 && !n.fwdPutBack(back) {
			for _, p := range back {
				n.resolve(p, ErrStopped)
			}
		}
		return
	}
	ents := make([]pb.Entry, 0, len(ps))
	fresh := ps[:0]
	for _, p := range ps {
		// A record already on its way or in the log (a slave's retried
		// forward, a requeue) is not logged twice: it shares the outcome
		// of the copy that is.
		if live := n.live[p.id]; live != nil {
			live.also = append(live.also, p)
			continue
		}
		if idx, ok := n.logged.get(p.id); ok && n.holds(idx, p.id) {
			p.index = idx
			if p.mode == Async {
				n.resolve(p, nil)
			} else {
				n.waitSync(p)
			}
			continue
		}
		ents = append(ents, pb.Entry{Data: p.data})
		fresh = append(fresh, p)
		n.live[p.id] = p // a copy later in this same batch shares it
	}
	if len(ents) == 0 {
		return
	}
	if err := n.rn.Step(pb.Message{Type: pb.MsgProp, From: n.id, Entries: ents}); err != nil {
		for _, p := range fresh {
			n.resolve(p, fmt.Errorf("%w (%v)", ErrNotLeader, err))
		}
		return
	}
	for _, p := range fresh {
		p.stepped = true
		n.pending[p.id] = p
		n.byDue = append(n.byDue, p)
	}
}

// waitSync adds a saved sync proposal to syncWait, kept in index order.
func (n *Node) waitSync(p *proposal) {
	i, _ := slices.BinarySearchFunc(n.syncWait, p.index, func(q *proposal, idx uint64) int {
		return cmp.Compare(q.index, idx)
	})
	n.syncWait = slices.Insert(n.syncWait, i, p)
	if !slices.Contains(n.byDue, p) {
		n.byDue = append(n.byDue, p)
	}
}

// handleReady processes one Ready; false means the node must stop.
func (n *Node) handleReady() bool {
	rd := n.rn.Ready()
	if rd.SoftState != nil {
		n.setLeader(rd.SoftState.RaftState == raft.StateLeader, rd.SoftState.Lead)
	}

	// A leader may send its appends while it writes the same entries to
	// its own disk (raft's README; etcd does the same): the slaves' fsync
	// then runs beside the master's instead of after it, which is most of
	// a sync ack's latency. Never before a new term or vote is on disk,
	// and never on a follower, whose answers promise what it has saved.
	early := n.leader && n.cfg.Transport != nil && len(rd.Messages) > 0 &&
		(raft.IsEmptyHardState(rd.HardState) || (rd.HardState.Term == n.savedHS.Term && rd.HardState.Vote == n.savedHS.Vote))
	if early {
		n.cfg.Transport.Send(rd.Messages)
	}
	if !raft.IsEmptySnap(rd.Snapshot) {
		// The master's log starts past this node's: it sent its
		// compaction point, which replaces the log here (storage keeps
		// it before the entries that follow it in this Ready).
		if err := n.db.ApplySnapshot(rd.Snapshot); err != nil {
			n.fail(fmt.Errorf("%w: %v", ErrStorage, err))
			return false
		}
		n.log.Warn("behind the master's first index: installed its compaction point; the records before it are not on this node",
			"index", rd.Snapshot.Metadata.Index, "term", rd.Snapshot.Metadata.Term)
	}
	hs := rd.HardState
	if last, _ := n.db.LastIndex(); !raft.IsEmptyHardState(hs) && hs.Term == n.savedHS.Term && hs.Vote == n.savedHS.Vote && hs.Commit <= last {
		// Only the commit index moved, and not past entries already on
		// disk (a follower commits what arrives in the same Ready): no
		// fsync of its own (SetCommit).
		n.db.SetCommit(hs)
		hs = pb.HardState{}
	}
	if len(rd.Entries) > 0 || !raft.IsEmptyHardState(hs) {
		if !n.save(hs, rd.Entries) {
			return false
		}
		if !raft.IsEmptyHardState(hs) {
			n.savedHS = hs
			n.term.Store(hs.Term)
		}
		if n.db.TakeRequeueSignal() {
			select {
			case n.requeueSig <- struct{}{}:
			default:
			}
		}
	}
	if n.leader {
		n.matchSaved(rd.Entries)
		n.flushResolved() // acks first: the rest of the Ready can wait
	} else if n.cfg.Forwarder != nil {
		n.noteLogged(rd.Entries)
	}
	if !early && n.cfg.Transport != nil && len(rd.Messages) > 0 {
		n.cfg.Transport.Send(rd.Messages)
	}
	if len(rd.CommittedEntries) > 0 {
		for i := range rd.CommittedEntries {
			if e := &rd.CommittedEntries[i]; e.Type != pb.EntryNormal {
				n.applyConfChange(e)
			}
		}
		select {
		case n.applyc <- rd.CommittedEntries:
		case <-n.stopc:
			return false
		case <-n.failc:
			return false
		}
	}
	n.rn.Advance(rd)
	n.checkSync()
	return true
}

// save persists one Ready, retrying a failing disk until it works or the
// node stops: raft has handed over this Ready and cannot take it back. While
// it fails, every waiting proposal fails with ErrStorage (0x97 to devices)
// and new ones fail at once, instead of hanging past sync_timeout.
func (n *Node) save(hs pb.HardState, ents []pb.Entry) bool {
	backoff := 10 * time.Millisecond
	for {
		err := n.db.Save(hs, ents)
		if err == nil {
			if n.diskErr.Load() != nil {
				n.log.Info("the log is writable again")
				n.diskErr.Store(nil)
			}
			return true
		}
		if errors.Is(err, storage.ErrClosed) {
			n.fail(fmt.Errorf("%w: %v", ErrStorage, err))
			return false
		}
		if n.diskErr.Load() == nil {
			n.log.Error("saving the log failed; refusing publishes and retrying", "error", err, "index", firstIndex(ents))
		}
		serr := fmt.Errorf("%w: %v", ErrStorage, err)
		n.diskErr.Store(&serr)
		n.failWaiting(serr)
		n.flushResolved()
		select {
		case <-time.After(backoff):
		case <-n.stopc:
			return false
		}
		if backoff < time.Second {
			backoff *= 2
		}
	}
}

// failWaiting fails every proposal not yet acked, queued ones included;
// the loop goes on.
func (n *Node) failWaiting(err error) {
	n.propMu.Lock()
	q := n.propQ
	n.propQ = nil
	n.propMu.Unlock()
	for _, p := range q {
		n.resolve(p, err)
	}
	for _, p := range n.byDue {
		n.resolve(p, err)
	}
	n.byDue, n.syncWait = nil, nil
	clear(n.pending)
	clear(n.live)
}

func firstIndex(ents []pb.Entry) uint64 {
	if len(ents) == 0 {
		return 0
	}
	return ents[0].Index
}

func (n *Node) setLeader(leader bool, lead uint64) {
	if leader != n.leader {
		n.log.Info("role changed", "master", leader, "leader", IDString(lead), "term", n.rn.BasicStatus().Term)
	}
	n.leader = leader
	if n.lead.Swap(lead) != lead {
		n.leaderChanges.Add(1)
	}
	if !leader {
		for _, w := range n.confWait {
			w.done <- ErrNotLeader
		}
		n.confWait = nil
		// Proposals not yet in a saved Ready will never be: raft dropped
		// them with the leadership.
		for id, p := range n.pending {
			delete(n.pending, id)
			n.resolve(p, ErrNotLeader)
		}
	}
}

// matchSaved resolves the proposals whose entries were just saved: async
// ones are acked now (on the master's disk); sync ones wait for replicas.
func (n *Node) matchSaved(ents []pb.Entry) {
	if len(n.pending) == 0 {
		return
	}
	for i := range ents {
		e := &ents[i]
		if e.Type != pb.EntryNormal || len(e.Data) == 0 {
			continue
		}
		origin, seq, err := storage.RecordID(e.Data)
		if err != nil {
			continue
		}
		id := recID{origin, seq}
		p := n.pending[id]
		if origin != n.id || (p != nil && p.viaStream) {
			// Only another node's records come again (a slave's retried
			// forward, a deposed master's requeue), and this node's own
			// that went through the forward stream (another master may
			// have logged them too): others are proposed once, so they
			// need no entry here.
			n.logged.add(id, e.Index)
		}
		if p == nil {
			continue
		}
		delete(n.pending, p.id)
		p.index = e.Index
		if p.mode == Async {
			n.resolve(p, nil)
		} else {
			n.syncWait = append(n.syncWait, p)
		}
	}
}

// noteLogged remembers where the records a follower saves are: should this
// node become the master, the forward streams of the slaves (its own
// included) send again whatever the old master had not answered, and what
// it logged must be answered from the log, not logged twice.
func (n *Node) noteLogged(ents []pb.Entry) {
	for i := range ents {
		e := &ents[i]
		if e.Type != pb.EntryNormal || len(e.Data) == 0 {
			continue
		}
		if origin, seq, err := storage.RecordID(e.Data); err == nil {
			n.logged.add(recID{origin, seq}, e.Index)
		}
	}
}

// updateFloor tells storage how far retention may drop: on the master, the
// lowest Match of the other members, so nothing a member still lacks goes.
// Every member in the configuration counts, heard from recently or not: a
// member the log has passed can only install the compaction point and loses
// the records in between (DB.ApplySnapshot), until snapshots carry the
// broker state and catch-up streams the kept records. A member that never
// answered has Match 0 and holds everything. On a slave (and a candidate)
// storage's own bound applies: what it has applied.
func (n *Node) updateFloor() {
	floor := uint64(math.MaxUint64)
	if n.leader {
		n.rn.WithProgress(func(id uint64, _ raft.ProgressType, pr tracker.Progress) {
			if id != n.id {
				floor = min(floor, pr.Match)
			}
		})
	}
	n.floor.Store(floor)
	n.db.SetRetentionFloor(floor)
}

// catchingUp reports whether this node has yet to apply up to CatchUpTo.
func (n *Node) catchingUp() bool {
	to := n.catchUp.Load()
	if to == 0 {
		return false
	}
	if n.db.Applied() >= to {
		n.catchUp.Store(0)
		return false
	}
	return true
}

// holds reports whether the log entry at index is still the record id: an
// entry recentLogged remembers may since have been overwritten (and moved
// to the requeue bucket) when this node lost the mastership, and the record
// must then be logged again, not taken as logged.
func (n *Node) holds(index uint64, id recID) bool {
	ents, err := n.db.Entries(index, index+1, math.MaxUint64)
	if err != nil || len(ents) != 1 {
		return false
	}
	o, s, err := storage.RecordID(ents[0].Data)
	return err == nil && o == id.origin && s == id.seq
}

// checkSync acks the sync proposals that enough other members hold, as
// their Progress.Match says (learners count: a 2-gateway slave is one).
func (n *Node) checkSync() {
	if len(n.syncWait) == 0 || !n.leader {
		return
	}
	k := n.cfg.MinSyncReplicas
	var top [2]uint64 // the k highest Match among others; k ≤ 2
	n.rn.WithProgress(func(id uint64, _ raft.ProgressType, pr tracker.Progress) {
		if id == n.id {
			return
		}
		m := pr.Match
		if m > top[0] {
			top[0], top[1] = m, top[0]
		} else if m > top[1] {
			top[1] = m
		}
	})
	if k < 1 || k > len(top) {
		return
	}
	covered := top[k-1]
	i := 0
	for ; i < len(n.syncWait) && n.syncWait[i].index <= covered; i++ {
		n.resolve(n.syncWait[i], nil)
	}
	n.syncWait = n.syncWait[i:]
}

// resolve reports p's outcome once, and the same outcome to the copies
// of its record that waited on it.
func (n *Node) resolve(p *proposal, err error) {
	if p.resolved {
		return
	}
	p.resolved = true
	n.resolvedSome = true
	if p.counted {
		n.batch.left()
	}
	if n.live[p.id] == p {
		delete(n.live, p.id)
	}
	for _, q := range p.also {
		q.index = p.index
		n.resolve(q, err)
	}
	if err != nil {
		if p.stepped {
			// Its publisher hears "refused", yet the record may be in the
			// log: should this node's requeue ever meet it, it is dropped.
			n.noteRefused(p.id, p.index)
		}
		p.done(0, err)
		return
	}
	p.done(p.index, nil)
}

// flushResolved lets AfterResolve act on the callbacks run since the last
// call (acks written in one go per client).
func (n *Node) flushResolved() {
	if n.resolvedSome && n.cfg.AfterResolve != nil {
		n.cfg.AfterResolve()
	}
	n.resolvedSome = false
}

// expire fails the proposals past their deadline and drops resolved ones
// from the head of byDue.
func (n *Node) expire(now time.Time) {
	i := 0
	for ; i < len(n.byDue); i++ {
		p := n.byDue[i]
		if !p.resolved {
			if now.Before(p.deadline) {
				break
			}
			delete(n.pending, p.id)
			n.resolve(p, ErrAckTimeout)
		}
	}
	if i > 0 {
		n.byDue = append(n.byDue[:0], n.byDue[i:]...)
	}
	j := 0
	for ; j < len(n.syncWait) && n.syncWait[j].resolved; j++ {
	}
	n.syncWait = n.syncWait[j:]
}

// resolveAll fails every unresolved proposal, queued ones included, and
// makes later proposals fail at once: the loop is exiting.
func (n *Node) resolveAll(err error) {
	n.propMu.Lock()
	n.closedErr = err
	n.propMu.Unlock()
	n.failWaiting(err)
	n.flushResolved()
}

// applyConfChange applies a membership entry on the raft goroutine, as raft
// requires, records the new conf state and the members' details, and wakes
// the proposer waiting for it.
func (n *Node) applyConfChange(e *pb.Entry) {
	var cc pb.ConfChangeI
	var ctx []byte
	var id uint64
	switch e.Type {
	case pb.EntryConfChange:
		var c pb.ConfChange
		if err := c.Unmarshal(e.Data); err != nil {
			n.fail(fmt.Errorf("replication: conf change at %d: %v: %w", e.Index, err, storage.ErrCorrupt))
			return
		}
		cc, ctx, id = c, c.Context, c.ID
	case pb.EntryConfChangeV2:
		var c pb.ConfChangeV2
		if err := c.Unmarshal(e.Data); err != nil {
			n.fail(fmt.Errorf("replication: conf change at %d: %v: %w", e.Index, err, storage.ErrCorrupt))
			return
		}
		cc, ctx = c, c.Context
	default:
		return
	}
	cs := n.rn.ApplyConfChange(cc)
	n.db.SetConfState(*cs)
	for _, ch := range cc.AsV2().Changes {
		n.recordMember(ch, ctx)
		n.log.Info("membership changed", "change", ch.Type.String(), "peer", IDString(ch.NodeID), "index", e.Index)
	}
	if id != 0 {
		n.confApplied(id, nil)
	}
}

// applyLoop delivers committed records in order and records the applied
// index after them, so a restart resumes where delivery stopped.
func (n *Node) applyLoop() {
	defer n.wg.Done()
	for ents := range n.applyc {
		if n.Err() != nil {
			continue
		}
		for i := range ents {
			e := &ents[i]
			if e.Type != pb.EntryNormal || len(e.Data) == 0 {
				continue
			}
			if err := n.cfg.Applier.Apply(e.Index, e.Data); err != nil {
				n.fail(fmt.Errorf("replication: apply %d: %w", e.Index, err))
				break
			}
		}
		if n.Err() == nil {
			n.db.SetApplied(ents[len(ents)-1].Index)
		}
	}
}
