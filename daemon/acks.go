package daemon

import (
	"sync"

	"github.com/tandem-edge/tandem/mqtt"
)

// ackQueue carries the outcomes of the broker's proposals from the
// replication goroutine, which resolves them, to the broker: the raft
// goroutine only appends to a slice and signals, and the broker's done
// callbacks (which mark acks and wake connection writers under the
// broker's locks) run on the queue's own goroutine. Outcomes keep their
// order. Replication calls AfterResolve after each run of callbacks
// (clusterHost), which flushes the queue: one wake-up per run drains every
// outcome the run resolved, instead of a goroutine switch per ack.
type ackQueue struct {
	mu      sync.Mutex // guards pending and closed
	pending []ackOutcome
	closed  bool
	sig     chan struct{} // capacity 1: wakes run
	done    chan struct{} // closed when run has ended
}

// ackOutcome is one proposal's outcome for its done callback.
type ackOutcome struct {
	done mqtt.Done
	err  error
}

// newAckQueue starts a queue; stop ends it.
func newAckQueue() *ackQueue {
	q := &ackQueue{sig: make(chan struct{}, 1), done: make(chan struct{})}
	go q.run()
	return q
}

// push queues an outcome until the next flush; after stop it is delivered
// at once (nobody is left to wait for, and the callback must still run
// exactly once).
func (q *ackQueue) push(done mqtt.Done, err error) {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		done.Done(err)
		return
	}
	q.pending = append(q.pending, ackOutcome{done, err})
	q.mu.Unlock()
}

// flush wakes the queue's goroutine to run what push queued.
func (q *ackQueue) flush() {
	select {
	case q.sig <- struct{}{}:
	default:
	}
}

func (q *ackQueue) run() {
	defer close(q.done)
	var batch []ackOutcome
	// A connection's acks are written once per run, not once per
	// outcome (a client with 64 publishes in a batch: one write).
	var r mqtt.Resolver
	for {
		<-q.sig
		q.mu.Lock()
		batch, q.pending = q.pending, batch[:0]
		closed := q.closed
		q.mu.Unlock()
		for i := range batch {
			r.Resolve(batch[i].done, batch[i].err)
			batch[i] = ackOutcome{}
		}
		r.Flush()
		if closed {
			return
		}
	}
}

// stop delivers what is queued and ends the queue; outcomes pushed later
// run on the caller's goroutine.
func (q *ackQueue) stop() {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return
	}
	q.closed = true
	q.mu.Unlock()
	select {
	case q.sig <- struct{}{}:
	default:
	}
	<-q.done
}
