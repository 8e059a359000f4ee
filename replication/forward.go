package replication

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"
)

// Forwarder carries forward batches, tandem's own request rather than raft's
// proposal forwarding, whose proposals can vanish silently (DESIGN.md), to
// the master: Forward sends one encoded batch and returns the master's
// encoded answer (HandleForward's return on that node). An error means no
// answer came: the batch may or may not have been logged.
type Forwarder interface {
	Forward(ctx context.Context, master uint64, batch []byte) ([]byte, error)
}

// The forward stream: one per node, in arrival order. MQTT requires each
// client's publishes to keep their order; a publish per request (or per
// goroutine) lets a client's in-flight window land shuffled whenever a new
// master appears. So every record this node takes while another node is the
// master (or while older records are still on their way) joins one queue,
// sent in batches over a window of requests: a sender goroutine takes
// everything queued, sends it as one request and, answered, takes the next.
// The master proposes each batch whole, in the order the stream numbered
// them (fwdInbound), and answers per record once each meets its ack rule.
// On a master change, a lost link or a "not the master" answer, the
// unanswered tail goes again, in the same order, as a new epoch: record ids
// make the master answer a copy it already logged from the log
// (proposeQueued), so nothing is logged twice. When this node becomes the
// master, forwardLoop proposes the tail here, still before any newer record.
//
// A record that waits past its deadline (sync_timeout after Propose) fails
// with ErrAckTimeout, the "no slave reachable" outcome, or ErrNoMaster, but
// only while no request carrying it can have reached a master: refused is
// final (DESIGN.md, "Guarantees"). A record the master may have had is
// answered by the master alone. On a slow link its answer can come after
// the deadline, and a slave that gave up then told its device "refused"
// for a record the master logged a moment later (issue #32: 1,000 ms each
// way and 1 % loss, 119 of 126 refused publishes were in the log). So the
// stream counts the requests out with each record (proposal.out) and marks
// it in doubt once one returns without an answer that is not provably
// unsent (ErrNotSent); such a record is never expired. It goes again, in
// a new epoch, until a master answers for it: from its log if it logged it
// (record ids: nothing is logged twice), or by logging it now. The device
// may wait longer than sync_timeout for that answer, but the answer is
// true. The master's own refusals stay final: a sync record past its
// deadline there is aborted by its settlement, whatever the slave heard.
// When this node becomes the master, the records in doubt are proposed
// here under the same ids.

// Tuning of the stream: how many batches may be in flight at once, and how
// big one may grow. The master logs each batch as a commit of its own
// (HandleForward hurries it: the rest of the slave's publishers wait on the
// slave, so the master's group commit would wait for them in vain), and a
// commit costs an fsync on every member, so a batch must carry a commit's
// worth. The stream therefore has a group commit of its own (fwdStream.gate,
// batch.go's gate, over the records the stream holds): it holds the queue
// until the slave's closed-loop population is in, at most twice their usual
// turnaround (a lone publisher never waits). Without it, the first
// publisher back from an answer left alone and the rest followed in two or
// three batches per round (bench C6/C7, 50 clients with window 1 on a
// slave: 0.065 fsyncs per publish on the master; 0.032 with the gate, and
// 0.027 with the same clients on the master). Two batches in flight let one
// leave while the other waits for its ack, which a sync record's second
// fsync makes long (one in flight: 0.024 fsyncs per publish, but C7 lost a
// fifth); more split the publishers into more, smaller batches (windows
// 4–32 cost more CPU per publish than 1–2).
const (
	fwdWindow     = 2
	fwdMaxRecords = 1024
	fwdMaxBytes   = 1 << 20
	// fwdPoll is how often forwardLoop checks who the master is, so a
	// master that dies takes no answers with it for long, and fails the
	// records past their deadline.
	fwdPoll = 10 * time.Millisecond
	// fwdIdlePoll is forwardLoop's poll while the stream holds nothing:
	// there is no deadline to keep then, and fwdTake follows a master
	// change itself before the first record goes. Polling every fwdPoll
	// when idle cost an idle member a third of its CPU (9-15 ms/s against
	// 7-8 on the bench machine; more on a gateway's ARM core).
	fwdIdlePoll = 250 * time.Millisecond
	// fwdBackoff is the pause after a failed request before the tail goes
	// again, so a master that cannot answer does not spin the senders.
	fwdBackoff = 20 * time.Millisecond
)

// fwdStream is the node's forward queue and its requests in flight.
type fwdStream struct {
	mu    sync.Mutex  // guards every field but sig
	queue []*proposal // taken, not yet sent (or to be sent again), in order
	// held counts records in queue or in flight: while it is above zero, a
	// new record queues behind them even on the master.
	held int
	// closed is set when forwardLoop has ended: take then leaves records
	// to the raft queue, which refuses them once stopped.
	closed   bool
	master   uint64      // where batches go; 0 while none is known or it is this node
	epoch    uint64      // numbers the stream's restarts; batches carry it
	nextSeq  uint64      // the next batch's number in the epoch
	inflight []*fwdBatch // sent, not wholly answered, by seq
	senders  int         // sender goroutines running, at most fwdWindow
	ctx      context.Context
	cancel   context.CancelFunc // ends the epoch's requests
	pauseTo  time.Time          // no sending before this (after a failure)
	slow     bool               // forwardLoop polls every fwdIdlePoll: the stream was empty
	heard    time.Time          // the last answer from a master

	// gate holds the queue back until the population of the slave's
	// publishers is in (a wait it arms wakes forwardLoop).
	gate groupCommit

	sig chan struct{} // capacity 1: wakes forwardLoop
}

// fwdBatch is one request of the stream; recs[i] is nil once resolved.
type fwdBatch struct {
	seq  uint64
	recs []*proposal
}

// fwdSend is a batch as its sender sends it: what it read of the stream
// when it took the batch, in the same hold of the lock, so a restart
// between taking and sending cannot give the batch another epoch's
// number, nor let an expiry change its records under the encoder.
type fwdSend struct {
	b        *fwdBatch
	recs     []*proposal // b's records as sent: each counts this request in its out
	epoch    uint64
	master   uint64
	ctx      context.Context
	payload  []byte
	deadline time.Time // the latest of its records'
}

// fwdOutcome is a resolved record and its outcome, called outside the lock.
type fwdOutcome struct {
	p   *proposal
	err error
}

// fwdTake queues p on the stream when it must go there: another node is
// the master (away), or older records are still in it. It reports whether
// it did; if not, the caller proposes p here.
func (n *Node) fwdTake(p *proposal, away bool) bool {
	s := &n.fwd
	s.mu.Lock()
	if s.closed || (!away && s.held == 0) {
		s.mu.Unlock()
		return false
	}
	idle := s.held == 0
	if idle {
		// forwardLoop polls slowly while the stream is empty: the master
		// may have changed since it last looked.
		n.fwdFollowLocked()
	}
	s.queue = append(s.queue, p)
	s.held++
	// The gate's population is the most records the stream held at once:
	// all its publishers are in just before an answer, while the next
	// batch waits behind the one in flight.
	s.gate.peak = max(s.gate.peak, int64(s.held))
	// A free slot sends it now, once the gate lets it (a wait the gate
	// arms wakes forwardLoop itself); busy senders take it with their
	// next batch; with none and no master to send to, forwardLoop hands it
	// off or finds the master, or resumes after a pause; the first record
	// after a pause also brings it back to its quick poll.
	started := n.fwdSenderLocked()
	wake := (idle && s.slow) || (!started && s.senders == 0 && !n.fwdReadyLocked())
	s.mu.Unlock()
	if wake {
		signal(s.sig)
	}
	return true
}

// fwdSenderLocked starts a sender with the next batch if the stream has a
// master to send to, something to send, a free slot and its population in
// (fwdGateLocked). The Add happens under s.mu while the stream is open, so
// forwardLoop (which closes it before it ends) still holds its count: Add
// never races with Stop's Wait.
func (n *Node) fwdSenderLocked() bool {
	s := &n.fwd
	if s.senders >= fwdWindow || !n.fwdReadyLocked() || !n.fwdGateLocked() {
		return false
	}
	x := n.fwdNextLocked()
	s.senders++
	n.goFunc(func() { n.fwdSender(x) })
	return true
}

// fwdReadyLocked reports whether there is something to send and someone
// to send it to now.
func (n *Node) fwdReadyLocked() bool {
	s := &n.fwd
	return !s.closed && s.master != 0 && len(s.queue) > 0 && !time.Now().Before(s.pauseTo)
}

// fwdGateLocked is the stream's group commit: whether the queue may leave
// now. Its population is what the stream holds (queued or in flight, the
// records whose publishers wait for an answer); a wait it arms signals
// forwardLoop, which starts a sender then.
func (n *Node) fwdGateLocked() bool {
	s := &n.fwd
	if len(s.queue) >= fwdMaxRecords {
		s.gate.now() // a full batch has all the company it can take (a backlog drains at once)
	}
	s.gate.inNode.Store(int64(s.held))
	return s.gate.take(time.Now(), true, func() { signal(s.sig) })
}

// fwdPutBack puts ps, proposals the raft loop took but could not propose
// (this node lost the mastership first), at the head of the stream: they
// are older than anything queued since. False if the stream has ended.
func (n *Node) fwdPutBack(ps []*proposal) bool {
	for _, p := range ps {
		p.reuse = false // the stream may hold it past its outcome
	}
	s := &n.fwd
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return false
	}
	s.queue = append(append(make([]*proposal, 0, len(ps)+len(s.queue)), ps...), s.queue...)
	s.held += len(ps)
	s.mu.Unlock()
	signal(s.sig)
	return true
}

// fwdSender sends x, then further batches one at a time while the gate
// lets them go.
func (n *Node) fwdSender(x fwdSend) {
	s := &n.fwd
	for {
		rctx, cancel := context.WithDeadline(x.ctx, x.deadline)
		answer, err := n.cfg.Forwarder.Forward(rctx, x.master, x.payload)
		cancel()
		more := n.fwdAnswer(x, answer, err)
		s.mu.Lock()
		if more && n.fwdReadyLocked() && n.fwdGateLocked() {
			x = n.fwdNextLocked()
			s.mu.Unlock()
			continue
		}
		s.senders--
		s.mu.Unlock()
		return
	}
}

// fwdNextLocked takes the next batch off the queue into the window; the
// caller checked fwdReadyLocked.
func (n *Node) fwdNextLocked() fwdSend {
	s := &n.fwd
	k, size := 0, 0
	for k < len(s.queue) && k < fwdMaxRecords && (k == 0 || size+len(s.queue[k].data) <= fwdMaxBytes) {
		size += len(s.queue[k].data)
		k++
	}
	b := &fwdBatch{seq: s.nextSeq, recs: append([]*proposal(nil), s.queue[:k]...)}
	x := fwdSend{b: b, recs: slices.Clone(b.recs), epoch: s.epoch, master: s.master, ctx: s.ctx, payload: encodeForward(s.epoch, b.seq, b.recs), deadline: b.recs[0].deadline}
	doubt := false
	for _, p := range b.recs {
		p.stepped = true // from now on the master may log it
		p.out++
		doubt = doubt || p.doubt
		x.deadline = later(x.deadline, p.deadline)
	}
	if doubt {
		// Records in doubt are past caring about their deadline: their
		// answer is what counts, and a request cut at a deadline already
		// gone would only go again at once. It waits sync_timeout for
		// the answer (a slow link's round trip), then goes again.
		x.deadline = later(x.deadline, time.Now().Add(n.cfg.SyncTimeout))
	}
	s.nextSeq++
	s.queue = append(s.queue[:0], s.queue[k:]...)
	s.inflight = append(s.inflight, b)
	return x
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// fwdAnswer resolves the records of x's batch, answered (or not: err). A
// lost answer or a "not the master" for any record sends the whole
// unanswered tail again, in order, as a new epoch, after a pause; it then
// reports false: the sender stops, forwardLoop resumes sending.
func (n *Node) fwdAnswer(x fwdSend, answer []byte, err error) bool {
	s := &n.fwd
	b := x.b
	var outcomes []error
	if err == nil {
		s.mu.Lock()
		s.heard = time.Now()
		s.mu.Unlock()
		outcomes, err = decodeForwardAnswer(answer, len(b.recs))
		if err != nil {
			n.log.Warn("unreadable answer to a forward batch; sending it again", "peer", IDString(s.master), "error", err)
		}
	}
	s.mu.Lock()
	// Whatever the epoch, this request is back: only an error that proves
	// it never left keeps its records out of doubt. A "not the master"
	// answer does not either: a master deposed after it took a record may
	// have left it in a log the next master commits.
	reached := !errors.Is(err, ErrNotSent)
	for _, p := range x.recs {
		p.out--
		p.doubt = p.doubt || reached // once answered, nobody looks again
	}
	if x.epoch != s.epoch {
		s.mu.Unlock()
		return true // an epoch already given up: its records went again
	}
	again := err != nil
	var out []fwdOutcome
	for i, p := range b.recs {
		if p == nil || err != nil {
			continue
		}
		if errors.Is(outcomes[i], ErrNotLeader) {
			again = true // not logged there: it goes again, to the master
			continue
		}
		out = append(out, fwdOutcome{p, outcomes[i]})
		b.recs[i] = nil
	}
	s.held -= len(out)
	if again {
		n.fwdRestartLocked()
		s.pauseTo = time.Now().Add(fwdBackoff)
	} else {
		n.fwdDropAnsweredLocked()
	}
	s.mu.Unlock()
	n.fwdResolve(out)
	return !again
}

// fwdResolve reports outcomes, outside the stream's lock: a callback may
// take its caller's locks, whose holders may be proposing.
func (n *Node) fwdResolve(out []fwdOutcome) {
	if len(out) == 0 {
		return
	}
	for _, o := range out {
		if o.err != nil && o.p.stepped {
			// The master may have logged it, and its copy reach this
			// node's log: its requeue must never re-publish it.
			n.noteRefused(o.p.id, 0)
		}
		o.p.finish(0, o.err)
	}
	if n.cfg.AfterResolve != nil {
		n.cfg.AfterResolve()
	}
}

// fwdDropAnsweredLocked forgets in-flight batches wholly resolved.
func (n *Node) fwdDropAnsweredLocked() {
	s := &n.fwd
	keep := s.inflight[:0]
	for _, b := range s.inflight {
		for _, p := range b.recs {
			if p != nil {
				keep = append(keep, b)
				break
			}
		}
	}
	clear(s.inflight[len(keep):])
	s.inflight = keep
}

// fwdRestartLocked ends the current epoch: requests in flight are
// cancelled and their unresolved records go back to the head of the
// queue, in order.
func (n *Node) fwdRestartLocked() {
	s := &n.fwd
	if len(s.inflight) == 0 && s.nextSeq == 0 {
		return // nothing sent in this epoch: it can go on
	}
	s.cancel()
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.epoch++
	s.nextSeq = 0
	var back []*proposal
	for _, b := range s.inflight {
		for _, p := range b.recs {
			if p != nil {
				back = append(back, p)
			}
		}
	}
	s.inflight = nil
	if len(back) > 0 {
		s.queue = append(back, s.queue...)
	}
}

// forwardLoop follows the master for the stream: it restarts the stream
// on a change, hands it off when this node is the master, resumes sending
// after a pause and fails what waited past its deadline.
func (n *Node) forwardLoop() {
	s := &n.fwd
	s.mu.Lock()
	s.epoch = uint64(time.Now().UnixNano()) // above any earlier run's
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.mu.Unlock()
	t := time.NewTicker(fwdPoll)
	defer t.Stop()
	period := fwdPoll
	for {
		tick := false
		select {
		case <-s.sig:
		case <-t.C:
			tick = true
		case <-n.stopc:
			n.fwdClose(ErrStopped)
			return
		case <-n.failc:
			n.fwdClose(n.errOr(ErrStopped))
			return
		}
		n.fwdStep(time.Now(), tick)
		s.mu.Lock()
		s.slow = s.held == 0
		p := fwdPoll
		if s.slow {
			p = fwdIdlePoll
		}
		s.mu.Unlock()
		if p != period {
			period = p
			t.Reset(p)
		}
	}
}

// fwdFollowLocked points the stream at the current master, restarting it
// on a change, and returns the master. The caller holds s.mu.
func (n *Node) fwdFollowLocked() (lead uint64) {
	s := &n.fwd
	lead = n.Leader()
	remote := lead
	if lead == n.id {
		remote = 0
	}
	if remote != s.master {
		s.master = remote
		n.fwdRestartLocked()
		s.pauseTo = time.Time{}
	}
	return lead
}

// fwdStep is one look of forwardLoop (deadlines on ticks only: they need
// not be met to the millisecond, and a long queue is not scanned on every
// arrival).
func (n *Node) fwdStep(now time.Time, tick bool) {
	s := &n.fwd
	var out []fwdOutcome
	s.mu.Lock()
	lead := n.fwdFollowLocked()
	if tick || (lead == n.id && len(s.queue) > 0) {
		out = n.fwdExpireLocked(now)
	}
	var q []*proposal
	if lead == n.id {
		// This node is the master: propose the tail here. held stays up
		// until the records are in the raft queue, so one taken meanwhile
		// queues behind them and is handed off at the next look. What
		// is in doubt is past its deadline, or soon: it gets a deadline
		// of its own here, or this node's expire would refuse a record
		// it is about to log.
		q = s.queue
		s.queue = nil
		for _, p := range q {
			if p.doubt || p.out > 0 {
				p.deadline = later(p.deadline, now.Add(n.cfg.SyncTimeout))
			}
		}
	} else {
		// Resume after a pause, a master change or the gate's wait
		// (a sender may be out with the previous batch).
		n.fwdSenderLocked()
	}
	s.mu.Unlock()
	n.fwdResolve(out)
	if len(q) == 0 {
		return
	}
	for _, p := range q {
		p.viaStream = true
		n.enqueue(p)
	}
	s.mu.Lock()
	s.held -= len(q)
	s.mu.Unlock()
}

// fwdExpireLocked takes the records past their deadline off the stream,
// to be failed with ErrAckTimeout.
func (n *Node) fwdExpireLocked(now time.Time) []fwdOutcome {
	s := &n.fwd
	var out []fwdOutcome
	// No master known, or none answered since the record was taken (a
	// 2-gateway slave still names its dead master): say so.
	why := func(p *proposal) error {
		if n.Leader() == 0 || s.heard.Before(p.deadline.Add(-n.cfg.SyncTimeout)) {
			return ErrNoMaster
		}
		return ErrAckTimeout
	}
	// Only what no master can have: a record in a request still out, or
	// in doubt, waits for its answer.
	expired := func(p *proposal) bool { return p.out == 0 && !p.doubt && !now.Before(p.deadline) }
	for _, b := range s.inflight {
		for i, p := range b.recs {
			if p != nil && expired(p) {
				out = append(out, fwdOutcome{p, why(p)})
				b.recs[i] = nil
			}
		}
	}
	keep := s.queue[:0]
	for _, p := range s.queue {
		if expired(p) {
			out = append(out, fwdOutcome{p, why(p)})
		} else {
			keep = append(keep, p)
		}
	}
	clear(s.queue[len(keep):])
	s.queue = keep
	s.held -= len(out)
	if len(out) > 0 {
		n.fwdDropAnsweredLocked()
	}
	return out
}

// fwdClose fails everything the stream holds and closes it: the node is
// stopping. Senders still running see their requests cancelled.
func (n *Node) fwdClose(err error) {
	s := &n.fwd
	s.mu.Lock()
	n.fwdRestartLocked()
	s.cancel()
	var out []fwdOutcome
	for _, p := range s.queue {
		out = append(out, fwdOutcome{p, err})
	}
	s.queue, s.held, s.closed = nil, 0, true
	if s.gate.timer != nil {
		s.gate.timer.Stop() // nothing is left to wait for
	}
	s.mu.Unlock()
	n.fwdResolve(out)
}

// fwdInbound orders the batches one peer's stream sends this master:
// handlers run concurrently, so each waits for its turn (epoch, seq) before
// it proposes. mu guards epoch, next and turn.
type fwdInbound struct {
	mu    sync.Mutex
	epoch uint64
	next  uint64
	turn  chan struct{} // closed and replaced whenever next or epoch moves
}

// inbound returns from's sequencer.
func (n *Node) inbound(from uint64) *fwdInbound {
	n.inMu.Lock()
	defer n.inMu.Unlock()
	in := n.inboundBy[from]
	if in == nil {
		in = &fwdInbound{turn: make(chan struct{})}
		n.inboundBy[from] = in
	}
	return in
}

// errStaleBatch answers a batch of an epoch its stream has already left.
var errStaleBatch = errors.New("replication: forward batch of an ended epoch")

// HandleForward is the master's side of Forwarder.Forward: it proposes the
// records of a batch from peer from, in its stream's order and once however
// often they come, and returns the encoded answers when each record meets
// its ack rule (or with why not).
func (n *Node) HandleForward(ctx context.Context, from uint64, batch []byte) ([]byte, error) {
	epoch, seq, recs, err := decodeForward(batch)
	if err != nil {
		return nil, err
	}
	codes := make([]error, len(recs))
	if n.Leader() != n.id {
		for i := range codes {
			codes[i] = ErrNotLeader
		}
		return encodeForwardAnswer(codes), nil
	}
	in := n.inbound(from)
	for {
		in.mu.Lock()
		if epoch < in.epoch || (epoch == in.epoch && seq < in.next) {
			in.mu.Unlock()
			return nil, errStaleBatch
		}
		if (epoch == in.epoch && seq == in.next) || (epoch > in.epoch && seq == 0) {
			break // in.mu held: propose under it, so batches keep their order
		}
		turn := in.turn
		in.mu.Unlock()
		select {
		case <-turn:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	var mu sync.Mutex // guards codes and left
	left := len(recs)
	all := make(chan struct{})
	var allOnce sync.Once
	resolve := func(i int, err error) {
		mu.Lock()
		codes[i] = err
		left--
		if left == 0 {
			allOnce.Do(func() { close(all) })
		}
		mu.Unlock()
	}
	deadline := time.Now().Add(n.cfg.SyncTimeout)
	for i, r := range recs {
		if n.cfg.Admit != nil {
			if err := n.cfg.Admit(r.data); err != nil {
				resolve(i, err)
				continue
			}
		}
		p := &proposal{id: r.id, data: r.data, mode: r.mode, deadline: deadline, inbound: true,
			to: outcomeFunc(func(_ uint64, err error) { resolve(i, err) })}
		n.enqueue(p)
	}
	in.epoch, in.next = epoch, seq+1
	close(in.turn)
	in.turn = make(chan struct{})
	in.mu.Unlock()
	n.batch.now()
	n.wakeProposals()
	select {
	case <-all:
	case <-ctx.Done():
		return nil, ctx.Err() // the slave gave up; it resends or fails them
	}
	mu.Lock()
	defer mu.Unlock()
	return encodeForwardAnswer(codes), nil
}

// recentLogged remembers where records were logged, so a forwarded retry
// of one is answered from the log instead of being logged twice. Bounded:
// each origin keeps its last recentLoggedCap sequence numbers, in a ring
// indexed by the sequence number itself. A node numbers its records in
// order, so a slot is taken over by a record recentLoggedCap later (or by
// one of a later epoch), the oldest going first. Every follower and the
// master of forwarded records note every record they save: a hash map of
// 64 Ki ids cost 10-14 % of a slave's CPU in C2 and C6 (cache misses, and
// an insert plus a delete per record), the ring one store.
type recentLogged struct {
	origins []*loggedRing // few, most recently used first: the members that ever originated records
}

// loggedRing is one origin's ring: slot seq%recentLoggedCap holds seq and
// the index it was saved at (seq 0 is never a record's, so an empty slot
// matches nothing).
type loggedRing struct {
	origin uint64
	slots  []loggedSlot
}

type loggedSlot struct{ seq, index uint64 }

const (
	recentLoggedCap = 1 << 16
	// maxLoggedOrigins bounds the rings kept: a cluster has at most three
	// members, but members come and go over the years; the least recently
	// used origin is forgotten first.
	maxLoggedOrigins = 8
)

// ring returns origin's ring, making it when create is set (nil otherwise).
func (r *recentLogged) ring(origin uint64, create bool) *loggedRing {
	for i, g := range r.origins {
		if g.origin == origin {
			// Move to the front (most often it is there already): the
			// least recently used is last.
			copy(r.origins[1:i+1], r.origins[:i])
			r.origins[0] = g
			return g
		}
	}
	if !create {
		return nil
	}
	g := &loggedRing{origin: origin, slots: make([]loggedSlot, recentLoggedCap)}
	if len(r.origins) < maxLoggedOrigins {
		r.origins = append(r.origins, nil)
	}
	copy(r.origins[1:], r.origins)
	r.origins[0] = g
	return g
}

func (r *recentLogged) add(id recID, index uint64) {
	// logged again: the newest place counts
	r.ring(id.origin, true).slots[id.seq%recentLoggedCap] = loggedSlot{id.seq, index}
}

func (r *recentLogged) get(id recID) (uint64, bool) {
	g := r.ring(id.origin, false)
	if g == nil || id.seq == 0 {
		return 0, false
	}
	s := g.slots[id.seq%recentLoggedCap]
	return s.index, s.seq == id.seq
}
