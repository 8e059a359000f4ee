package replication

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
)

// Catch-up after a snapshot.
//
// A member that installed a snapshot at index X holds the broker state at
// X, not the records before it; its sessions' cursors point into them. The
// master may still hold some (from its first index on). The backfill loop
// pulls them from the master, newest first (a session resuming wants the
// most recent ones; retention would drop the oldest first anyway), in
// chunks of at most backfillChunk bytes that end where the previous one
// began, one request per backfillEvery: at most backfillChunk /
// backfillEvery (2.5 MiB/s) beside the master's own traffic. They go to
// storage's backfill bucket (storage/backfill.go), where a session's replay
// reads them. Progress is recorded with each chunk: a restart or a lost
// link resumes where it was. Status says CatchingUp meanwhile.

// Backfiller carries a backfill request to the master and returns its
// answer (HandleBackfill there).
type Backfiller interface {
	Backfill(ctx context.Context, master uint64, req []byte) ([]byte, error)
}

const (
	// backfillChunk bounds the records of one answer, in bytes.
	backfillChunk = 256 << 10
	// backfillEvery is the least time between two requests.
	backfillEvery = 100 * time.Millisecond
	// backfillTimeout bounds one request.
	backfillTimeout = 5 * time.Second
	// backfillCount is how many records a request asks for at first;
	// it halves while an answer would pass backfillChunk and doubles back
	// up to backfillMaxCount.
	backfillCount, backfillMaxCount = 1024, 16384
)

// backfillProgress counts what the current catch-up pulled, for status and
// `tandem cluster join`'s progress bar. Written by backfillLoop, read by
// status.
type backfillProgress struct {
	records, bytes atomic.Uint64
	// masterFirst is the master's first index as its last answer gave
	// it: the catch-up ends there. 0 until the first answer.
	masterFirst atomic.Uint64
}

// reset starts the counts of a new catch-up.
func (p *backfillProgress) reset() {
	p.records.Store(0)
	p.bytes.Store(0)
	p.masterFirst.Store(0)
}

// CatchUp is the progress of a catch-up (Status.CatchUp).
type CatchUp struct {
	Records, Bytes uint64 // pulled so far
	// Left is how many records are still to come, -1 until the master
	// has answered once.
	Left int64
}

// errNoBackfill answers a request to a member that is not the master.
var errNoBackfill = errors.New("replication: backfill asked of a member that is not the master")

// HandleBackfill is the master's side of a backfill request (below, n):
// the n committed records before index below, or those of them from its
// first index on, with its first index; when they pass backfillChunk
// bytes, the newest of them that fit. (Reject, which asked for a smaller
// n, is no longer sent; a member still takes it.)
func (n *Node) HandleBackfill(req []byte) ([]byte, error) {
	if len(req) == snapPullLen && req[0] == snapPullTag {
		return n.handleSnapshotPull(req) // a snapshot's body (snappull.go)
	}
	if len(req) != 16 {
		return nil, fmt.Errorf("replication: backfill request of %d bytes", len(req))
	}
	if n.Leader() != n.id {
		return nil, errNoBackfill
	}
	below, count := binary.BigEndian.Uint64(req), binary.BigEndian.Uint64(req[8:])
	first, _ := n.db.FirstIndex()
	last, _ := n.db.LastIndex()
	hi := min(below, last+1, n.db.HardState().Commit+1)
	ans := pb.Message{Index: first}
	if count > 0 && hi > first {
		lo := max(first, hi-min(count, hi-first))
		for {
			ents, err := n.db.Entries(lo, hi, backfillChunk)
			if err != nil {
				return nil, err
			}
			if len(ents) > 0 && ents[len(ents)-1].Index == hi-1 {
				ans.Entries = ents
				break
			}
			// More than a chunk from lo on: the len(ents) records from
			// lo fit, and as many just before hi are about as large.
			// Answering those (nearer hi each time; one record always
			// fits) keeps every answer a full chunk: a Reject made the
			// member halve its count and double it again, every other
			// request wasted (0.8 MB/s instead of the cap, measured).
			if len(ents) == 0 || hi-lo < 2 {
				break // nothing readable there now: the member asks again
			}
			lo = hi - min(uint64(len(ents)), hi-lo-1)
		}
	}
	return ans.Marshal()
}

// backfillLoop pulls the records before an installed snapshot from the
// master while storage wants them.
func (n *Node) backfillLoop() {
	t := time.NewTicker(backfillEvery)
	defer t.Stop()
	count := uint64(backfillCount)
	pulling, pulled := false, 0
	for n.pace(t.C, nil) {
		if n.pull.installing.Load() {
			continue // the install frees the pages the records go to (snappull.go)
		}
		below, ok := n.db.BackfillWanted()
		if !ok {
			if pulling {
				n.log.Info("caught up: the records before the snapshot that the master still held are here", "records", pulled, "from", n.db.OldestIndex())
				pulling = false
			}
			continue
		}
		lead := n.Leader()
		if lead == 0 || lead == n.id {
			continue
		}
		if !pulling {
			n.log.Info("catching up: pulling the records before the snapshot from the master, newest first", "below", below)
			pulling, pulled = true, 0
			n.bf.reset()
		}
		got, reject, err := n.pullBackfill(lead, below, count)
		switch {
		case err != nil:
			n.log.Debug("backfill request failed; trying again", "error", err)
		case reject:
			count = max(1, count/2)
		default:
			pulled += got
			if uint64(got) == count {
				count = min(2*count, backfillMaxCount)
			}
		}
	}
}

// pullBackfill asks master for count records before below and stores
// them; it returns how many came, or that they were too many.
func (n *Node) pullBackfill(master, below, count uint64) (int, bool, error) {
	req := binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(nil, below), count)
	ctx, cancel := context.WithTimeout(context.Background(), backfillTimeout)
	defer cancel()
	b, err := n.cfg.Backfill.Backfill(ctx, master, req)
	if err != nil {
		return 0, false, err
	}
	var ans pb.Message
	if err := ans.Unmarshal(b); err != nil {
		return 0, false, fmt.Errorf("backfill answer: %w", err)
	}
	if ans.Reject {
		return 0, true, nil
	}
	// Done once the master has nothing older: it answered up to its first
	// index, or nothing at all (retention took the rest there too).
	done := len(ans.Entries) == 0 || ans.Entries[0].Index <= ans.Index
	if err := n.db.PutBackfill(ans.Entries, done); err != nil {
		n.fail(fmt.Errorf("%w: %v", ErrStorage, err))
		return 0, false, err
	}
	var size uint64
	for i := range ans.Entries {
		size += uint64(len(ans.Entries[i].Data))
	}
	n.bf.records.Add(uint64(len(ans.Entries)))
	n.bf.bytes.Add(size)
	n.bf.masterFirst.Store(max(ans.Index, 1))
	return len(ans.Entries), false, nil
}

// CatchingUp reports whether this member is pulling the records before an
// installed snapshot from the master (or is to, once it has one).
func (n *Node) CatchingUp() bool {
	_, ok := n.catchUpProgress()
	return ok
}

// catchUpProgress reports the progress of the catch-up, if one is under way.
func (n *Node) catchUpProgress() (CatchUp, bool) {
	if n.db.InstallInterrupted() {
		// A snapshot merged into the broker state in part: the state
		// is incomplete until the master sends one again.
		return CatchUp{Left: -1}, true
	}
	if n.cfg.Backfill == nil {
		return CatchUp{}, false
	}
	below, ok := n.db.BackfillWanted()
	if !ok {
		return CatchUp{}, false
	}
	c := CatchUp{Records: n.bf.records.Load(), Bytes: n.bf.bytes.Load(), Left: -1}
	if first := n.bf.masterFirst.Load(); first > 0 {
		c.Left = int64(below) - int64(first)
		c.Left = max(c.Left, 0)
	}
	return c, true
}
