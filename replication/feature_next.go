//go:build tandem_next

package replication

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// A test build of a next release (go build -tags tandem_next; never
// shipped): peer protocol 2, feature level 5 (storage/kind_next.go), and a
// record kind gated behind level 5 that a master writes once the cluster
// runs at it. The e2e upgrade test upgrades a cluster of the release to
// this build and shows the note is written only once every member runs
// it, before a real format change relies on the gating.

// peerProtocolMax is the highest peer protocol version this build speaks
// (frame.go).
const peerProtocolMax = 2

// levelExtras: whether this node, as master, has logged its note.
type levelExtras struct {
	noteLogged atomic.Bool
}

// levelWork logs one KindNote record on a master once the cluster runs at
// storage.FeatureNote; another master (or this one restarted) logs its
// own. Loop-owned.
func (n *Node) levelWork(now time.Time) {
	if n.FeatureLevel() < storage.FeatureNote || n.catchingUp() || !n.extras.noteLogged.CompareAndSwap(false, true) {
		return
	}
	rec := storage.Record{Kind: storage.KindNote, Origin: n.id, Seq: n.NextSeq(), Time: clock.Now().UnixNano(),
		Payload: fmt.Appendf(nil, "feature level %d: notes allowed", storage.FeatureNote)}
	p := &proposal{data: storage.AppendRecord(nil, &rec), mode: Async, control: true, deadline: now.Add(n.cfg.SyncTimeout)}
	p.id = recID{rec.Origin, rec.Seq}
	p.to = outcomeFunc(func(index uint64, err error) {
		if err != nil {
			n.extras.noteLogged.Store(false) // the next tick tries again
			n.log.Warn("note not logged; tried again", "error", err)
			return
		}
		n.log.Info("note logged", "index", index, "level", storage.FeatureNote)
	})
	n.enqueue(p)
}
