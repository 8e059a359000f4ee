package replication

import (
	"sync"
	"time"

	"github.com/tandem-edge/tandem/storage"
)

// requeueLoop re-proposes the records a conflicting append moved to the
// requeue bucket: the tail of a deposed master, which it may have acked as
// async (DESIGN.md, "Truncation eats async acks"). Each goes to the current
// master marked as re-published, keeps its record id (so a copy the master
// already has is not logged twice), and leaves the bucket once logged.
// Failures are retried; the bucket survives restarts.
func (n *Node) requeueLoop() {
	defer n.wg.Done()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-n.requeueSig:
		case <-t.C:
		case <-n.stopc:
			return
		case <-n.failc:
			return
		}
		// Round after round while rounds come back full and clean: a
		// deposed master's tail can be thousands of records.
		total := 0
		for {
			done, again := n.republish()
			total += done
			if !again {
				break
			}
			select {
			case <-n.stopc:
				return
			default:
			}
		}
		if total > 0 {
			n.log.Info("re-published requeued records (a deposed master's tail)", "records", total, "requeued_since_start", n.requeuedTotal.Load())
		}
	}
}

// requeueBatch is how many requeued records one round proposes at once.
const requeueBatch = 1024

// republish proposes one round of requeued records and waits for them. It
// returns how many were logged, and whether another round should follow at
// once (this one was full and all of it was logged).
func (n *Node) republish() (int, bool) {
	items, err := n.db.Requeued(requeueBatch)
	if err != nil {
		n.log.Error("reading requeued records failed", "error", err)
		return 0, false
	}
	if len(items) == 0 {
		return 0, false
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	done := 0
	for _, it := range items {
		rec, err := storage.DecodeRecord(it.Data)
		if err != nil {
			n.log.Error("requeued record unreadable; kept for inspection", "index", it.Index, "error", err)
			continue
		}
		rec.Republished = true
		data := storage.AppendRecord(nil, &rec)
		wg.Add(1)
		key := it.Key
		n.Propose(data, Async, func(_ uint64, err error) {
			defer wg.Done()
			if err != nil {
				return // retried next round
			}
			n.db.DropRequeued(key)
			mu.Lock()
			done++
			mu.Unlock()
		})
	}
	wg.Wait()
	if done == 0 {
		return 0, false
	}
	n.requeuedTotal.Add(uint64(done))
	// The drops ride on a commit: make it now, so the next round does
	// not read them again.
	if err := n.db.Flush(); err != nil {
		return done, false
	}
	return done, done == len(items) && len(items) == requeueBatch
}

// Requeued returns how many records this node has re-published since start.
func (n *Node) Requeued() uint64 { return n.requeuedTotal.Load() }
