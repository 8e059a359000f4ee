package replication

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"go.etcd.io/raft/v3/tracker"

	"github.com/tandem-edge/tandem/storage"
)

// Snapshots pulled by reference.
//
// A snapshot larger than storage's inline limit does not travel in raft's
// MsgSnap (a peer frame holds 16 MiB, and a broker state can be larger):
// the message carries a storage.SnapshotRef instead. The raft goroutine
// does not step such a message; it hands it to the pull loop, which asks
// the member that sent it for the body in chunks of at most snapChunk
// bytes, one request per snapEvery (10 MiB/s beside the master's own
// traffic, whose raft loop serving them never sees), over the same
// requests as the backfill (Backfiller). Each chunk received is decoded
// into storage's staging in the data file (storage.SnapshotIn), after the
// log the snapshot supersedes was dropped: a request that fails (a cut
// link) is asked again from the same offset. Once the whole body is here
// and its CRC checks, the message is stepped with the staged ref as its
// data, and raft installs it as any snapshot (snapshot.go), moving the
// staged buckets in place; its answer moves the master on. The pull loop
// waits for that step to be done (installed, or declined by raft) before it
// takes another offer or drops the staging: the install reads it, and a new
// pull would replace it.
//
// The master, meanwhile, has the member's progress in raft's snapshot
// state, which ends only with that answer or a ReportSnapshot. It reports
// a failure, so that raft sends the snapshot again (the current build),
// when the member pulls one it no longer holds, or when the member pulled
// nothing for snapStuck election timeouts (a MsgSnap lost on the way, a
// member that restarted).

const (
	// snapChunk bounds the bytes of one pull's answer.
	snapChunk = 1 << 20
	// snapEvery is the least time between two pull requests.
	snapEvery = 100 * time.Millisecond
	// snapStuck is how many election timeouts a master waits for a pull
	// before it has raft send the snapshot again.
	snapStuck = 5
	// snapPullTag starts a pull request; it is longer than a backfill
	// request (16 bytes), which it shares a request kind with.
	snapPullTag = 'S'
	// snapPullLen: tag, requester u64, ref (index u64, size u64, crc
	// u32), offset u64, most bytes u32.
	snapPullLen = 1 + 8 + 8 + 8 + 4 + 8 + 4
)

// snapPuller hands MsgSnaps carrying a ref from the raft goroutine to the
// pull loop: mu guards offered, the newest one; sig wakes the loop.
type snapPuller struct {
	mu      sync.Mutex
	offered *pb.Message
	sig     chan struct{}
	// pulling is the body bytes received of the snapshot being pulled,
	// -1 while none is (written by the pull loop; tests read it).
	pulling atomic.Int64
	// stepping says the raft goroutine stepped a staged snapshot in this
	// turn (raft goroutine only); stepped then tells the pull loop, once
	// the Readys that followed are handled (stepDone).
	stepping bool
	stepped  chan struct{}
	// installing is set while the apply goroutine installs a snapshot,
	// the Restorer's reload of the state included: the backfill waits
	// for it. The reload reads the whole state in a read transaction,
	// which keeps bbolt from reusing the pages the install freed until
	// it ends; records pulled meanwhile took new pages (1.5 MB past the
	// budget, measured with a 7 MB state).
	installing atomic.Bool
}

// snapServer notes, on the master, the pulls members made since the raft
// goroutine last looked: mu guards pulled and gone (by member id; gone:
// it asked for a snapshot no longer held).
type snapServer struct {
	mu           sync.Mutex
	pulled, gone map[uint64]bool
}

// pullInstead takes a MsgSnap that carries a ref rather than a snapshot
// off raft's way, for the pull loop; false means step m as it is. One at
// or below the commit index is stepped: raft ignores it and answers with
// what this member has. Raft goroutine only.
func (n *Node) pullInstead(m pb.Message) bool {
	if m.Type != pb.MsgSnap || m.Snapshot == nil {
		return false
	}
	if ref, ok := storage.ParseStagedSnapshot(m.Snapshot.Data); ok {
		// The pull loop's, once it staged the body; any other (a peer
		// sending one) names nothing this member can install.
		n.pull.stepping = true
		if !n.db.SnapshotStaged(ref) {
			n.log.Warn("dropped a snapshot naming one received here, which this member does not hold", "index", ref.Index, "peer", IDString(m.From))
			return true
		}
		return false
	}
	ref, ok := storage.ParseSnapshotRef(m.Snapshot.Data)
	if !ok || m.Snapshot.Metadata.Index <= n.rn.BasicStatus().Commit {
		return false
	}
	if n.cfg.Backfill == nil {
		n.log.Error("the master sent a snapshot to pull, and this node has no way to pull it (no Backfill configured)", "index", ref.Index, "bytes", ref.Size)
		return true
	}
	n.pull.mu.Lock()
	n.pull.offered = &m
	n.pull.mu.Unlock()
	select {
	case n.pull.sig <- struct{}{}:
	default:
	}
	return true
}

// snapPullLoop pulls the body of the snapshot offered last and steps it
// once whole.
func (n *Node) snapPullLoop() {
	every := n.cfg.snapEvery
	if every == 0 {
		every = snapEvery
	}
	t := time.NewTicker(every)
	defer t.Stop()
	var (
		in *storage.SnapshotIn
		m  pb.Message // the MsgSnap in is the body of
	)
	drop := func() {
		if in != nil {
			in.Close()
			in = nil
		}
		n.pull.pulling.Store(-1)
	}
	defer drop()
	for n.pace(t.C, n.pull.sig) {
		n.pull.mu.Lock()
		o := n.pull.offered
		n.pull.offered = nil
		n.pull.mu.Unlock()
		if o != nil {
			ref, _ := storage.ParseSnapshotRef(o.Snapshot.Data)
			if in == nil || in.Ref() != ref {
				drop()
				var err error
				if in, err = n.db.ReceiveSnapshot(ref); err != nil {
					n.log.Error("cannot receive the master's snapshot", "error", err)
					in = nil
					continue
				}
				n.pull.pulling.Store(0)
				n.log.Info("pulling the master's snapshot of the broker state", "index", ref.Index, "bytes", ref.Size, "peer", IDString(o.From))
			}
			m = *o // the same snapshot, perhaps from a new sender
		}
		if in == nil {
			continue
		}
		if n.db.HardState().Commit >= in.Ref().Index {
			drop() // this member has come past it another way
			continue
		}
		if err := n.pullChunk(m.From, in); err != nil {
			if errors.Is(err, storage.ErrSnapshotGone) {
				drop() // an install took the staging: the master sends what is next
				continue
			}
			n.log.Debug("snapshot pull failed; asking again", "error", err, "offset", in.Offset())
			continue
		}
		n.pull.pulling.Store(int64(in.Offset()))
		if !in.Done() {
			continue
		}
		data, err := in.Finish()
		if err != nil {
			drop()
			if errors.Is(err, storage.ErrCorrupt) {
				n.log.Error("the pulled snapshot is damaged; waiting for the master to send it again", "error", err)
			} else {
				n.log.Warn("the pulled snapshot could not be made ready to install; waiting for the master to send it again", "error", err)
			}
			continue
		}
		snap := *m.Snapshot
		snap.Data = data
		m.Snapshot = &snap
		select {
		case <-n.pull.stepped: // a signal of a step before this one
		default:
		}
		n.Step(m)
		select {
		case <-n.pull.stepped:
		case <-n.stopc:
			return
		case <-n.failc:
			return
		}
		// Installed (the staging went with it), or declined by raft
		// (this member came past it another way): either way the
		// staging is done with.
		drop()
	}
}

// stepDone tells the pull loop that the staged snapshot the raft goroutine
// stepped in this turn was handled: the Readys that followed it, an
// install among them, are done. Raft goroutine, after each turn's Readys.
func (n *Node) stepDone() {
	if !n.pull.stepping {
		return
	}
	n.pull.stepping = false
	select {
	case n.pull.stepped <- struct{}{}:
	default:
	}
}

// pace waits for a tick of c or a wake-up on wake (nil: none); false once
// the node stops.
func (n *Node) pace(c <-chan time.Time, wake <-chan struct{}) bool {
	select {
	case <-n.stopc:
		return false
	case <-n.failc:
		return false
	case <-wake:
	case <-c:
	}
	return true
}

// pullChunk asks master for the next chunk of in and stores it.
func (n *Node) pullChunk(master uint64, in *storage.SnapshotIn) error {
	most := n.cfg.snapChunk
	if most == 0 {
		most = snapChunk
	}
	ref := in.Ref()
	req := append(make([]byte, 0, snapPullLen), snapPullTag)
	req = binary.BigEndian.AppendUint64(req, n.id)
	req = binary.BigEndian.AppendUint64(req, ref.Index)
	req = binary.BigEndian.AppendUint64(req, ref.Size)
	req = binary.BigEndian.AppendUint32(req, ref.CRC)
	req = binary.BigEndian.AppendUint64(req, in.Offset())
	req = binary.BigEndian.AppendUint32(req, uint32(most))
	ctx, cancel := context.WithTimeout(context.Background(), backfillTimeout)
	defer cancel()
	chunk, err := n.cfg.Backfill.Backfill(ctx, master, req)
	if err != nil {
		return err
	}
	if len(chunk) == 0 {
		return errors.New("empty snapshot chunk")
	}
	return in.Write(chunk)
}

// handleSnapshotPull is the master's side of a pull request: the chunk of
// the snapshot body it names. Any member holding that body could answer;
// only a master builds one.
func (n *Node) handleSnapshotPull(req []byte) ([]byte, error) {
	from := binary.BigEndian.Uint64(req[1:])
	ref := storage.SnapshotRef{Index: binary.BigEndian.Uint64(req[9:]), Size: binary.BigEndian.Uint64(req[17:]), CRC: binary.BigEndian.Uint32(req[25:])}
	off, most := binary.BigEndian.Uint64(req[29:]), int(binary.BigEndian.Uint32(req[37:]))
	most = min(max(most, 1), 4*snapChunk)
	chunk, err := n.db.ReadSnapshot(ref, off, most)
	n.serve.mu.Lock()
	if n.serve.pulled == nil {
		n.serve.pulled, n.serve.gone = map[uint64]bool{}, map[uint64]bool{}
	}
	n.serve.pulled[from] = true
	if errors.Is(err, storage.ErrSnapshotGone) {
		n.serve.gone[from] = true
	}
	n.serve.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("replication: snapshot at %d: %w", ref.Index, err)
	}
	return chunk, nil
}

// watchSnapshots has raft send a snapshot again to a member that pulled
// one this master no longer holds, or nothing for snapStuck election
// timeouts while raft waits for it. Raft goroutine, on each tick as master.
func (n *Node) watchSnapshots() {
	n.serve.mu.Lock()
	pulled, gone := n.serve.pulled, n.serve.gone
	n.serve.pulled, n.serve.gone = nil, nil
	n.serve.mu.Unlock()
	if n.snapWait == nil {
		n.snapWait = map[uint64]uint64{}
	}
	stuck := uint64(snapStuck * n.cfg.ElectionTimeout / n.cfg.Heartbeat)
	var again []uint64
	n.rn.WithProgress(func(id uint64, _ raft.ProgressType, pr tracker.Progress) {
		if id == n.id || pr.State != tracker.StateSnapshot {
			delete(n.snapWait, id)
			return
		}
		since, ok := n.snapWait[id]
		if !ok || pulled[id] {
			since = n.ticks
			n.snapWait[id] = since
		}
		if gone[id] || n.ticks-since > stuck {
			again = append(again, id)
			delete(n.snapWait, id)
		}
	})
	for _, id := range again {
		n.log.Info("a member waits for a snapshot this master no longer sends: sending the current one", "peer", IDString(id))
		n.rn.ReportSnapshot(id, raft.SnapshotFailure)
	}
}
