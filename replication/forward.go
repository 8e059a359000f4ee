package replication

import (
	"context"
	"errors"
	"time"
)

// Forwarder carries a record taken on a slave to the master, as tandem's
// own request rather than raft's proposal forwarding, whose proposals can
// vanish silently (DESIGN.md). The master answers when the record meets
// mode's ack rule there: nil, or the error (ErrAckTimeout, ErrStorage...).
type Forwarder interface {
	Forward(ctx context.Context, master uint64, data []byte, mode AckMode) error
}

// forward sends p to the master, waiting for one to be known, and reports
// the outcome; it runs on a goroutine of its own and gives up at p's
// deadline with ErrAckTimeout, the "no slave reachable" outcome.
func (n *Node) forward(p *proposal) {
	ctx, cancel := context.WithDeadline(context.Background(), p.deadline)
	defer cancel()
	err := n.forwardOnce(ctx, p)
	if err != nil && ctx.Err() != nil {
		err = ErrAckTimeout
	}
	p.done(0, err)
	if n.cfg.AfterResolve != nil {
		n.cfg.AfterResolve()
	}
}

func (n *Node) forwardOnce(ctx context.Context, p *proposal) error {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		lead := n.Leader()
		switch {
		case lead == n.id:
			// This node became the master meanwhile: propose here.
			done := make(chan error, 1)
			n.enqueue(&proposal{id: p.id, data: p.data, mode: p.mode, deadline: p.deadline,
				done: func(_ uint64, err error) { done <- err }})
			select {
			case err := <-done:
				return err
			case <-ctx.Done():
				return ctx.Err()
			}
		case lead != 0:
			err := n.cfg.Forwarder.Forward(ctx, lead, p.data, p.mode)
			if !errors.Is(err, ErrNotLeader) {
				return err
			}
			// The master changed under us: ask the new one. The record
			// id makes a repeat harmless.
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		case <-n.stopc:
			return ErrStopped
		}
	}
}

// HandleForward is the master's side of Forward: it logs a record a slave
// took from a device, once however often the slave retries, and returns when
// the record meets mode's ack rule, or with why not.
func (n *Node) HandleForward(ctx context.Context, data []byte, mode AckMode) error {
	if n.Leader() != n.id {
		return ErrNotLeader
	}
	done := make(chan error, 1)
	n.Propose(data, mode, func(_ uint64, err error) { done <- err })
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ErrAckTimeout
	}
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
