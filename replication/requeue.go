package replication

import (
	"encoding/binary"
	"fmt"
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
	t := time.NewTicker(time.Second)
	defer t.Stop()
	lastPrune := time.Now()
	for {
		select {
		case <-n.requeueSig:
		case <-t.C:
			if time.Since(lastPrune) > time.Minute {
				lastPrune = time.Now()
				n.pruneRefused()
			}
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

// errDeposedTail answers a publisher whose record a conflicting append
// took out of this node's log: it is in no log, and is never re-published.
var errDeposedTail = fmt.Errorf("%w: this gateway was deposed before the record met its ack rule, and the new master's log does not hold it", ErrNotLeader)

// refuseRequeued answers, at once, the publishers still waiting here for
// records a conflicting append just moved to the requeue bucket: the tail
// of this node as a deposed (or paused) master, sync records whose ack
// rule was not met. They are in no log now. Left waiting, they would be
// refused at their sync_timeout, after the requeue loop had re-published
// them: delivered, though their devices were told they failed (issue
// #32). Refused now, their ids are noted refused (resolve) before the
// requeue loop reads the bucket, and it drops them. Runs on the loop, only
// when an append conflicted.
func (n *Node) refuseRequeued() {
	if len(n.live) == 0 {
		return
	}
	// By id alone, a chunk at a time: the bucket can hold a log budget's
	// worth of records, more than the gateway's memory budget.
	refused := 0
	err := n.db.RequeuedIDs(requeueBatch, func(origin, seq uint64) {
		if p := n.live[recID{origin, seq}]; p != nil && !p.resolved {
			n.resolve(p, errDeposedTail)
			refused++
		}
	})
	if err != nil {
		n.log.Error("reading requeued records failed", "error", err)
	}
	if refused > 0 {
		n.flushResolved()
		n.log.Info("refused the publishes this gateway's cut-off tail held: they are in no log and will not be re-published", "records", refused)
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
	refused, err := n.refusedIDs()
	if err != nil {
		n.log.Error("reading the refused records failed", "error", err)
		return 0, false
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	done, skipped, stale := 0, 0, 0
	for _, it := range items {
		rec, err := storage.DecodeRecord(it.Data)
		if err != nil {
			n.log.Error("requeued record unreadable; kept for inspection", "index", it.Index, "error", err)
			continue
		}
		// A settlement names indexes of the log it was cut from, which
		// hold other records now: the new master settles what it
		// inherited itself (settle.go).
		// A feature level raise is the master's to log, once; a control
		// kind this build does not know (a newer master's, in a tail
		// cut off by a downgrade) is nobody's to publish again.
		if rec.Kind == storage.KindSettle || rec.Kind == storage.KindFeature || rec.Kind > storage.KindFeature {
			n.db.DropRequeued(it.Key)
			stale++
			continue
		}
		// Its publisher was told "refused": publishing it now would make
		// that answer a lie (DESIGN.md: refused means not delivered).
		if k := refusedKey(rec.Origin, rec.Seq); refused[k] {
			n.db.DropRequeued(it.Key)
			n.db.StageDelete(bucketRefused, k)
			skipped++
			continue
		}
		rec.Republished = true
		// It was acked (a refused one is dropped above) or never
		// answered: it is re-published as an async record, delivered
		// once committed, not held for a settlement nobody will log.
		rec.Sync = false
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
	if skipped > 0 {
		n.refusedSkipped.Add(uint64(skipped))
		n.log.Info("requeued records not re-published: their publishers were refused", "records", skipped)
	}
	n.settlesSkipped.Add(uint64(stale))
	if skipped += stale; skipped > 0 {
		if err := n.db.Flush(); err != nil {
			return done, false
		}
	}
	if done == 0 {
		return 0, skipped > 0 && skipped == len(items) && len(items) == requeueBatch
	}
	n.requeuedTotal.Add(uint64(done))
	// The drops ride on a commit: make it now, so the next round does
	// not read them again.
	if err := n.db.Flush(); err != nil {
		return done, false
	}
	return done, done+skipped == len(items) && len(items) == requeueBatch
}

// Requeued returns how many records this node has re-published since start.
func (n *Node) Requeued() uint64 { return n.requeuedTotal.Load() }

// bucketRefused holds the ids of records this node refused after raft
// took them (a sync ack rule timed out, the disk failed, the node lost the
// mastership or stopped first) or, forwarded, whose refusal it passed on:
// the publisher was told "refused", yet the record may be in the log. With
// each, the highest index it can hold (for pruneRefused). Should such a
// record be requeued (this node was a deposed master and it sat in the
// divergent tail), it is dropped rather than re-published.
const bucketRefused = "refused"

// refusedSlack bounds how far past the log's end a refused record not yet
// saved here can still land: its index is unknown, so pruneRefused keeps it
// until retention passes the log's end then plus this.
const refusedSlack = 1 << 20

// refusedKey is a record id as a bucketRefused key.
func refusedKey(origin, seq uint64) string {
	var k [16]byte
	binary.BigEndian.PutUint64(k[:8], origin)
	binary.BigEndian.PutUint64(k[8:], seq)
	return string(k[:])
}

// noteRefused remembers that the record id was refused here (index: where
// it is in the log, 0 if unknown). It is staged, so it is durable with the
// next write: a deposed master may restart before it rejoins.
func (n *Node) noteRefused(id recID, index uint64) {
	if index == 0 {
		last, _ := n.db.LastIndex()
		index = last + refusedSlack
	}
	var v [8]byte
	binary.BigEndian.PutUint64(v[:], index)
	n.db.Stage(bucketRefused, refusedKey(id.origin, id.seq), v[:])
}

// refusedIDs returns the keys of bucketRefused.
func (n *Node) refusedIDs() (map[string]bool, error) {
	out := map[string]bool{}
	err := n.db.ForEach(bucketRefused, "", func(k, _ []byte) error {
		out[string(k)] = true
		return nil
	})
	return out, err
}

// pruneRefused forgets refused records the log no longer holds: retention
// dropped them, so no append can overwrite them into the requeue bucket.
// A lone gateway with sync topics refuses every sync publish; without
// this the bucket would grow for as long as it runs alone.
func (n *Node) pruneRefused() {
	first, err := n.db.FirstIndex()
	if err != nil {
		return
	}
	var drop []string
	_ = n.db.ForEach(bucketRefused, "", func(k, v []byte) error {
		if len(v) == 8 && binary.BigEndian.Uint64(v) != 0 && binary.BigEndian.Uint64(v) < first {
			drop = append(drop, string(k))
		}
		return nil
	})
	for _, k := range drop {
		n.db.StageDelete(bucketRefused, k)
	}
}

// RefusedSkipped returns how many requeued records this node dropped since
// start instead of re-publishing them, their publishers refused.
func (n *Node) RefusedSkipped() uint64 { return n.refusedSkipped.Load() }

// SettlementsSkipped returns how many requeued settlement records this
// node dropped since start: the new master settles what they covered.
func (n *Node) SettlementsSkipped() uint64 { return n.settlesSkipped.Load() }
