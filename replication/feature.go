package replication

import (
	"fmt"
	"sync"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// The cluster's feature level (DESIGN.md, "Versions and upgrades").
//
// Members of adjacent releases run together during a rolling upgrade. A
// new record kind or format (storage.FeatureControlKinds: control records
// told apart by their header) may only be written once every member's
// build reads it, or the member that cannot would skip what it must apply;
// a new rule of the replicated state (storage.FeaturePageCounts: how the
// caps on retained messages count) may only be applied once every member
// applies it, or their states part.
// So each member says in its peer hello the highest level its build knows,
// and the master, once every member of the membership has said a level at
// least as high as its own build's, logs a KindFeature record raising the
// cluster's level. Every member applies it in log order and from then on
// writes the new encoding; a snapshot carries the level to a member that
// installs one. The raise is automatic, as etcd raises its cluster version
// once every member runs the new minor: a field engineer upgrading a pair
// on site has no second step to forget. The price is etcd's too: once
// raised, a member cannot go back to the release before (its hello is
// refused with a message naming both levels; a data dir at a level its
// build does not know refuses to start and is left untouched).

// raiseEvery is how often a master whose cluster is below its build's
// level looks whether every member can take the raise: a member's hello
// comes when its link is (re)made, so there is nothing to hurry.
const raiseEvery = 2 * time.Second

// PeerBuilds is an extra a Transport may implement: what each member's
// build knows, from its latest hello. The master raises the feature level
// only on its word.
type PeerBuilds interface {
	// PeerBuild returns member id's highest feature level and release;
	// ok is false when no link to it was made since this node started.
	PeerBuild(id uint64) (level int, build string, ok bool)
}

// peerLevels is what each member's build said in its latest hello.
type peerLevels struct {
	mu sync.Mutex // guards m
	m  map[uint64]peerBuild
}

type peerBuild struct {
	level int
	build string
}

func (l *peerLevels) note(r Remote) {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[uint64]peerBuild{}
	}
	l.m[r.ID] = peerBuild{r.Level, r.Build}
	l.mu.Unlock()
}

// PeerBuild implements PeerBuilds.
func (t *PeerTransport) PeerBuild(id uint64) (int, string, bool) {
	t.levels.mu.Lock()
	defer t.levels.mu.Unlock()
	b, ok := t.levels.m[id]
	return b.level, b.build, ok
}

// levelOK refuses a member link to a build that does not know the
// cluster's feature level, and notes what the peer's build knows.
func (t *PeerTransport) levelOK(r Remote) error {
	want := storage.FeatureBase
	if t.cfg.FeatureLevel != nil {
		want = t.cfg.FeatureLevel()
	}
	if r.Level < want {
		build := r.Build
		if build == "" {
			build = "a release before feature levels"
		}
		return fmt.Errorf("peer %s runs %s, which knows feature levels up to %d; this cluster runs at level %d, whose records it cannot read: upgrade it to this gateway's release or newer", IDString(r.ID), build, r.Level, want)
	}
	t.levels.note(r)
	return nil
}

// FeatureLevel is the cluster's feature level as this member has applied
// it: what the records it writes may use.
func (n *Node) FeatureLevel() int { return int(n.level.Load()) }

// LegacyControl reports whether this member writes its control records in
// the encoding before record kinds (storage.Record.Legacy): until the
// cluster's level is FeatureControlKinds a member may run a build that
// reads them by their topic only.
func (n *Node) LegacyControl() bool { return n.FeatureLevel() < storage.FeatureControlKinds }

// PageCounts reports whether the caps on the broker's state count pages
// (storage.FeaturePageCounts) at the log position applied now. The level
// changes on the apply goroutine, between the records the Applier is
// given, so an Applier that asks it while applying a record gets the
// level of that record's position: the same answer on every member.
func (n *Node) PageCounts() bool { return n.FeatureLevel() >= storage.FeaturePageCounts }

// InboundResends reports whether every member delivers once a QoS 2
// resend and its original (storage.FeatureInboundResends): only then may
// a member log the session record that names a resend.
func (n *Node) InboundResends() bool { return n.FeatureLevel() >= storage.FeatureInboundResends }

// maybeRaiseLevel logs the raise of the cluster's feature level to this
// build's once every member's build knows it. Loop-owned; a master calls
// it from its ticks.
func (n *Node) maybeRaiseLevel(now time.Time) {
	if n.FeatureLevel() >= storage.FeatureLevel || now.Before(n.raiseAt) || n.catchingUp() {
		return
	}
	n.raiseAt = now.Add(raiseEvery)
	for _, m := range n.Members() {
		if m.ID == n.id {
			continue
		}
		if n.builds == nil {
			return
		}
		if level, _, ok := n.builds.PeerBuild(m.ID); !ok || level < storage.FeatureLevel {
			return // not yet: a member's build cannot read what the raise allows
		}
	}
	rec := storage.Record{Kind: storage.KindFeature, Origin: n.id, Seq: n.NextSeq(), Time: clock.Now().UnixNano(), Payload: []byte{storage.FeatureLevel}}
	p := &proposal{data: storage.AppendRecord(nil, &rec), mode: Async, control: true, deadline: now.Add(n.cfg.SyncTimeout)}
	p.id = recID{rec.Origin, rec.Seq}
	p.to = outcomeFunc(func(_ uint64, err error) {
		if err != nil {
			n.log.Debug("feature level raise not logged; tried again later", "level", storage.FeatureLevel, "error", err)
		}
	})
	n.enqueue(p)
}

// applyFeature applies a committed KindFeature record and reports
// whether e was one: the level only rises, and is staged to commit with
// the log that raised it. The Applier never sees these records; one this
// build cannot read is counted with the others it skips.
func (n *Node) applyFeature(e *pb.Entry) bool {
	if len(e.Data) == 0 || e.Data[0] != storage.RecordVersionControl {
		return false // the cheap test: every other record is not one
	}
	rec, err := storage.DecodeRecord(e.Data)
	if err != nil || rec.Kind != storage.KindFeature {
		return false // the Applier's, or it counts what it cannot read
	}
	if len(rec.Payload) != 1 {
		return false // unreadable: the Applier counts and skips it
	}
	level := int(rec.Payload[0])
	if level <= n.FeatureLevel() {
		return true
	}
	if level > storage.FeatureLevel {
		// The handshake keeps such a build out of the cluster; a log
		// that says so anyway is written by a newer master.
		n.log.Error("the cluster's feature level is above what this build knows: upgrade this gateway", "index", e.Index, "level", level, "known", storage.FeatureLevel)
		return true
	}
	n.level.Store(int32(level))
	n.db.StageFeatureLevel(level)
	n.log.Info("cluster feature level raised", "level", level, "index", e.Index)
	return true
}
