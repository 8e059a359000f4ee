package daemon

import (
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"

	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// One delivery per record on a deposed master's subscribers.
//
// A deposed master delivered its divergent tail to its own subscribers as
// it logged it. When it rejoins, that tail is requeued and comes back
// through the new master, re-published, at new indexes: delivered as is,
// every subscriber of the old master would get it twice. So, at the
// rejoin, the ids of the tail's records this node had applied (delivered)
// are kept, durably, and a record carrying one of those ids is not
// delivered again when it is applied; it still updates the retained store,
// which is a function of the log on every member. Each id is used once,
// then forgotten.

// metaDelivered holds the ids (origin, seq: 16 bytes each) of records this
// node delivered before a rejoin requeued them.
const metaDelivered = "cluster.delivered"

// redeliverSaveEvery is how many skips are persisted at once. After a
// crash the skips not persisted are still in the set: a record re-applied
// because its apply was not persisted either is skipped again, which is
// right; an id whose record will not come again only costs memory.
const redeliverSaveEvery = 256

// recordKey is a record id.
type recordKey [16]byte

func keyOf(origin, seq uint64) recordKey {
	var k recordKey
	binary.BigEndian.PutUint64(k[:8], origin)
	binary.BigEndian.PutUint64(k[8:], seq)
	return k
}

// redeliverer is the set of ids not to deliver again, and the Applier
// wrapper that consults it.
type redeliverer struct {
	d *Daemon

	count atomic.Int64 // len(ids): the hot path reads only this
	once  sync.Once    // loads the set from the data file

	mu     sync.Mutex // guards the fields below
	ids    map[recordKey]struct{}
	unsafe int // skips not yet persisted
}

// wrap puts the filter in front of next, the broker's applier.
func (r *redeliverer) wrap(next replication.Applier) replication.Applier {
	return redeliverApplier{r: r, next: next}
}

// redeliverApplier is replication's Applier: the daemon's applier behind
// the one-delivery filter.
type redeliverApplier struct {
	r    *redeliverer
	next replication.Applier
}

// Apply skips the delivery of a record this node already delivered, and
// hands every other record to the broker's applier.
func (a redeliverApplier) Apply(index uint64, data []byte) error {
	if a.r.skip(data) {
		err := a.r.retainOnly(index, data)
		a.r.d.broker.Delivered(index) // a session that replays skips it too
		return err
	}
	return a.next.Apply(index, data)
}

// Restore hands a snapshot to the broker's applier (replication.Restorer).
func (a redeliverApplier) Restore(index uint64, install func() error) error {
	if r, ok := a.next.(replication.Restorer); ok {
		return r.Restore(index, install)
	}
	return install()
}

// Holding implements replication.Holder for the applier behind.
func (a redeliverApplier) Holding() bool {
	h, ok := a.next.(replication.Holder)
	return ok && h.Holding()
}

// skip reports whether data's record was delivered here before, and
// forgets it if so. Records with no id (none are) and a node that was
// never deposed cost one atomic load.
func (r *redeliverer) skip(data []byte) bool {
	r.once.Do(r.load)
	if r.count.Load() == 0 {
		return false
	}
	origin, seq, err := storage.RecordID(data)
	if err != nil {
		return false
	}
	k := keyOf(origin, seq)
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.ids[k]; !ok {
		return false
	}
	delete(r.ids, k)
	r.count.Store(int64(len(r.ids)))
	r.unsafe++
	if r.unsafe >= redeliverSaveEvery || len(r.ids) == 0 {
		r.saveLocked()
	}
	return true
}

// retainOnly updates the retained store with data's record when it is a
// retained message, without delivering it.
func (r *redeliverer) retainOnly(index uint64, data []byte) error {
	_, retain, err := storage.RecordTopic(data)
	if err != nil || !retain {
		return err
	}
	rec, err := storage.DecodeRecord(data)
	if err != nil {
		return err
	}
	<-r.d.apply.ready
	r.d.broker.Retain(index, messageOf(&rec))
	return nil
}

// remember adds the ids of the data records in [from, upTo] of db's log:
// a deposed master's tail, as far as it applied (so delivered) it. It runs
// in the rejoin's prep, before the log is wiped; db is stopped.
func (r *redeliverer) remember(db *storage.DB, from, upTo uint64) error {
	r.once.Do(r.load)
	r.mu.Lock()
	defer r.mu.Unlock()
	if from == 0 || from > upTo {
		return nil
	}
	err := db.Scan(from, func(e raftpb.Entry) bool {
		if e.Index > upTo {
			return false
		}
		if e.Type == raftpb.EntryNormal && len(e.Data) > 0 {
			if o, s, err := storage.RecordID(e.Data); err == nil {
				r.ids[keyOf(o, s)] = struct{}{}
			}
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("remembering the delivered tail: %w", err)
	}
	r.count.Store(int64(len(r.ids)))
	return r.saveLocked()
}

// load reads the set from the data file.
func (r *redeliverer) load() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ids = map[recordKey]struct{}{}
	v, err := r.d.db.GetMeta(metaDelivered)
	if err != nil {
		r.d.log.Warn("reading the delivered tail's ids failed: its records may be delivered twice", "error", err)
		return
	}
	for ; len(v) >= 16; v = v[16:] {
		r.ids[recordKey(v[:16])] = struct{}{}
	}
	r.count.Store(int64(len(r.ids)))
}

// saveLocked writes the set to the data file; r.mu is held.
func (r *redeliverer) saveLocked() error {
	var v []byte
	if len(r.ids) > 0 {
		v = make([]byte, 0, 16*len(r.ids))
		for k := range r.ids {
			v = append(v, k[:]...)
		}
	}
	r.unsafe = 0
	if err := r.d.db.PutMeta(metaDelivered, v); err != nil {
		r.d.log.Warn("saving the delivered tail's ids failed", "error", err)
		return err
	}
	return nil
}

// pending returns how many ids wait for their re-published record.
func (r *redeliverer) pending() int { return int(r.count.Load()) }
