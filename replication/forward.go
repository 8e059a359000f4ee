package replication

import (
	"context"
	"errors"
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
// and one goroutine, forwardLoop, sends it in batches over a window of
// requests. The master proposes each batch whole, in the order the stream
// numbered them (fwdInbound), and answers per record once each meets its ack
// rule. On a master change, a lost link or a "not the master" answer, the
// unanswered tail goes again, in the same order, as a new epoch: record ids
// make the master answer a copy it already logged from the log
// (proposeQueued), so nothing is logged twice. When this node becomes the
// master, the tail is proposed here, still before any newer record.
//
// A record that waits past its deadline (sync_timeout after Propose) fails
// with ErrAckTimeout, the "no slave reachable" outcome.

// Tuning of the stream: how many batches may be in flight at once, and how
// big one may grow. A batch leaves as soon as a slot is free, so under load
// batches grow by themselves; the window keeps the link busy meanwhile.
const (
	fwdWindow     = 8
	fwdMaxRecords = 1024
	fwdMaxBytes   = 1 << 20
	// fwdPoll is how often the stream checks who the master is, so a
	// master that dies takes no answers with it for long.
	fwdPoll = 10 * time.Millisecond
	// fwdBackoff is the pause after a failed request before the tail goes
	// again, so a master that cannot answer does not spin the loop.
	fwdBackoff = 20 * time.Millisecond
)

// fwdStream is the node's forward queue. mu guards queue and held; the
// rest is owned by forwardLoop.
type fwdStream struct {
	mu    sync.Mutex
	queue []*proposal // taken, not yet sent (or to be sent again), in order
	// held counts records in queue or in flight: while it is above zero, a
	// new record queues behind them even on the master.
	held int
	sig  chan struct{} // capacity 1: wakes forwardLoop

	replies chan fwdReply

	// Loop-owned.
	master   uint64 // who the stream sends to; 0 while none is known
	epoch    uint64
	nextSeq  uint64
	inflight []*fwdBatch // sent, unanswered, by seq
	cancel   context.CancelFunc
	ctx      context.Context // of the current epoch: cancelled when it ends
	pauseTo  time.Time       // no sending before this (after a failure)
}

// fwdBatch is one request of the stream; recs[i] is nil once resolved.
type fwdBatch struct {
	seq  uint64
	recs []*proposal
}

// fwdReply is a request's outcome, posted back to forwardLoop.
type fwdReply struct {
	epoch, seq uint64
	answer     []byte
	err        error
}

// take queues p on the stream when it must go there: another node is the
// master (away), or older records are still in it. It reports whether it
// did; if not, the caller proposes p here.
func (s *fwdStream) take(p *proposal, away bool) bool {
	s.mu.Lock()
	if !away && s.held == 0 {
		s.mu.Unlock()
		return false
	}
	s.queue = append(s.queue, p)
	s.held++
	s.mu.Unlock()
	signal(s.sig)
	return true
}

// putBack puts ps, proposals the raft loop took but could not propose
// (this node lost the mastership first), at the head of the stream: they
// are older than anything queued since.
func (s *fwdStream) putBack(ps []*proposal) {
	s.mu.Lock()
	s.queue = append(append(make([]*proposal, 0, len(ps)+len(s.queue)), ps...), s.queue...)
	s.held += len(ps)
	s.mu.Unlock()
	signal(s.sig)
}

// forwardLoop runs the stream until the node stops.
func (n *Node) forwardLoop() {
	defer n.wg.Done()
	s := &n.fwd
	s.epoch = uint64(time.Now().UnixNano()) // above any earlier run's
	s.ctx, s.cancel = context.WithCancel(context.Background())
	t := time.NewTicker(fwdPoll)
	defer t.Stop()
	for {
		select {
		case <-s.sig:
		case r := <-s.replies:
			n.fwdAnswer(r)
		case <-t.C:
		case <-n.stopc:
			n.fwdClose(ErrStopped)
			return
		case <-n.failc:
			n.fwdClose(n.errOr(ErrStopped))
			return
		}
		n.fwdStep(time.Now())
	}
}

// fwdStep follows the master, fails what waited too long and sends or
// proposes what the stream holds.
func (n *Node) fwdStep(now time.Time) {
	s := &n.fwd
	lead := n.Leader()
	if lead != s.master {
		s.master = lead
		n.fwdRestart()
		s.pauseTo = time.Time{}
	}
	n.fwdExpire(now)
	switch {
	case lead == 0:
		return // an election: wait for its outcome
	case lead == n.id:
		n.fwdHandOff()
		return
	}
	if now.Before(s.pauseTo) {
		return
	}
	for len(s.inflight) < fwdWindow {
		b := n.fwdNext()
		if b == nil {
			return
		}
		n.fwdSend(b)
	}
}

// fwdNext takes the next batch off the queue; nil when it is empty.
func (n *Node) fwdNext() *fwdBatch {
	s := &n.fwd
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.queue) == 0 {
		return nil
	}
	k, size := 0, 0
	for k < len(s.queue) && k < fwdMaxRecords && (k == 0 || size+len(s.queue[k].data) <= fwdMaxBytes) {
		size += len(s.queue[k].data)
		k++
	}
	b := &fwdBatch{seq: s.nextSeq, recs: append([]*proposal(nil), s.queue[:k]...)}
	s.nextSeq++
	s.queue = append(s.queue[:0], s.queue[k:]...)
	return b
}

// fwdSend starts b's request on a tracked goroutine; its reply comes back
// through s.replies.
func (n *Node) fwdSend(b *fwdBatch) {
	s := &n.fwd
	s.inflight = append(s.inflight, b)
	payload := encodeForward(s.epoch, b.seq, b.recs)
	deadline := b.recs[len(b.recs)-1].deadline
	for _, p := range b.recs {
		deadline = later(deadline, p.deadline)
	}
	epoch, master, ectx := s.epoch, s.master, s.ctx
	n.goChild(func() {
		ctx, cancel := context.WithDeadline(ectx, deadline)
		answer, err := n.cfg.Forwarder.Forward(ctx, master, payload)
		cancel()
		select {
		case s.replies <- fwdReply{epoch: epoch, seq: b.seq, answer: answer, err: err}:
		case <-n.stopc:
		case <-n.failc:
		}
	})
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// fwdAnswer resolves the records of one answered batch. A lost answer or a
// "not the master" for any record sends the whole unanswered tail again,
// in order, as a new epoch.
func (n *Node) fwdAnswer(r fwdReply) {
	s := &n.fwd
	if r.epoch != s.epoch {
		return // an answer of an epoch already given up: its records went again
	}
	var b *fwdBatch
	for _, x := range s.inflight {
		if x.seq == r.seq {
			b = x
		}
	}
	if b == nil {
		return
	}
	var outcomes []error
	err := r.err
	if err == nil {
		outcomes, err = decodeForwardAnswer(r.answer, len(b.recs))
		if err != nil {
			n.log.Warn("unreadable answer to a forward batch; sending it again", "peer", IDString(s.master), "error", err)
		}
	}
	again := err != nil
	resolved := 0
	for i, p := range b.recs {
		if p == nil || err != nil {
			continue
		}
		if errors.Is(outcomes[i], ErrNotLeader) {
			again = true // not logged there: it goes again, to the master
			continue
		}
		p.done(0, outcomes[i])
		b.recs[i] = nil
		resolved++
	}
	if resolved > 0 {
		s.mu.Lock()
		s.held -= resolved
		s.mu.Unlock()
		if n.cfg.AfterResolve != nil {
			n.cfg.AfterResolve()
		}
	}
	if again {
		n.fwdRestart()
		s.pauseTo = time.Now().Add(fwdBackoff)
		return
	}
	n.fwdDropAnswered()
}

// fwdDropAnswered forgets in-flight batches whose records are all resolved.
func (n *Node) fwdDropAnswered() {
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

// fwdRestart ends the current epoch: requests in flight are cancelled and
// their unresolved records go back to the head of the queue, in order.
func (n *Node) fwdRestart() {
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
	if len(back) == 0 {
		return
	}
	s.mu.Lock()
	s.queue = append(back, s.queue...)
	s.mu.Unlock()
}

// fwdHandOff proposes everything the stream holds here, in order, now that
// this node is the master; records taken later are proposed after them
// (take sees held drop to zero only once they are in the raft queue).
func (n *Node) fwdHandOff() {
	s := &n.fwd
	n.fwdRestart()
	s.mu.Lock()
	q := s.queue
	s.queue = nil
	s.mu.Unlock()
	// held stays up until they are in the raft queue: a record taken
	// meanwhile queues behind them and is handed off at the next step.
	for _, p := range q {
		p.viaStream = true
		n.enqueue(p)
	}
	s.mu.Lock()
	s.held -= len(q)
	s.mu.Unlock()
}

// fwdExpire fails the records past their deadline with ErrAckTimeout.
func (n *Node) fwdExpire(now time.Time) {
	s := &n.fwd
	expired := 0
	var out []*proposal
	for _, b := range s.inflight {
		for i, p := range b.recs {
			if p != nil && !now.Before(p.deadline) {
				out = append(out, p)
				b.recs[i] = nil
			}
		}
	}
	s.mu.Lock()
	keep := s.queue[:0]
	for _, p := range s.queue {
		if now.Before(p.deadline) {
			keep = append(keep, p)
		} else {
			out = append(out, p)
		}
	}
	clear(s.queue[len(keep):])
	s.queue = keep
	expired = len(out)
	s.held -= expired
	s.mu.Unlock()
	if expired == 0 {
		return
	}
	for _, p := range out {
		p.done(0, ErrAckTimeout)
	}
	if n.cfg.AfterResolve != nil {
		n.cfg.AfterResolve()
	}
	n.fwdDropAnswered()
}

// fwdClose fails everything the stream holds: the node is stopping.
func (n *Node) fwdClose(err error) {
	s := &n.fwd
	n.fwdRestart()
	s.cancel()
	s.mu.Lock()
	q := s.queue
	s.queue, s.held = nil, 0
	s.mu.Unlock()
	for _, p := range q {
		p.done(0, err)
	}
	if len(q) > 0 && n.cfg.AfterResolve != nil {
		n.cfg.AfterResolve()
	}
}

// goChild starts f as a goroutine the node waits for on Stop. Only
// goroutines the node already tracks call it, so the counter is above zero
// and Add cannot race with Stop's Wait.
func (n *Node) goChild(f func()) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		f()
	}()
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
	deadline := time.Now().Add(n.cfg.SyncTimeout)
	for i, r := range recs {
		p := &proposal{id: r.id, data: r.data, mode: r.mode, deadline: deadline, inbound: true,
			done: func(_ uint64, err error) {
				mu.Lock()
				codes[i] = err
				left--
				if left == 0 {
					close(all)
				}
				mu.Unlock()
			}}
		n.enqueue(p)
	}
	in.epoch, in.next = epoch, seq+1
	close(in.turn)
	in.turn = make(chan struct{})
	in.mu.Unlock()
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
// the oldest ids are forgotten first.
type recentLogged struct {
	index map[recID]uint64
	order []recID
	next  int
}

const recentLoggedCap = 1 << 16

func (r *recentLogged) add(id recID, index uint64) {
	if r.index == nil {
		r.index = make(map[recID]uint64, recentLoggedCap)
		r.order = make([]recID, 0, recentLoggedCap)
	}
	if _, ok := r.index[id]; ok {
		r.index[id] = index // logged again: the newest place counts
		return
	}
	if len(r.order) < recentLoggedCap {
		r.order = append(r.order, id)
	} else {
		delete(r.index, r.order[r.next])
		r.order[r.next] = id
		r.next = (r.next + 1) % recentLoggedCap
	}
	r.index[id] = index
}

func (r *recentLogged) get(id recID) (uint64, bool) {
	i, ok := r.index[id]
	return i, ok
}
