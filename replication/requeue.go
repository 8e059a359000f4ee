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
		n.republish()
	}
}

// republish proposes one round of requeued records and waits for them.
func (n *Node) republish() {
	items, err := n.db.Requeued(256)
	if err != nil {
		n.log.Error("reading requeued records failed", "error", err)
		return
	}
	if len(items) == 0 {
		return
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
	if done > 0 {
		n.requeuedTotal.Add(uint64(done))
		n.log.Info("re-published records of a deposed master's tail", "records", done, "left", len(items)-done)
	}
}

// Requeued returns how many records this node has re-published since start.
func (n *Node) Requeued() uint64 { return n.requeuedTotal.Load() }
