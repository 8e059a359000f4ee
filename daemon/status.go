package daemon

import (
	"context"
	"errors"
	"syscall"
	"time"

	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/internal/version"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// status assembles the status JSON.
func (d *Daemon) status(ctx context.Context) (*admin.Status, error) {
	n := d.gw.Node()
	rs, err := n.Status(ctx)
	if errors.Is(err, replication.ErrStopped) {
		// A join, rejoin or promotion is replacing the node: wait for
		// it (the swap holds swapMu) and ask the new one.
		n = d.gw.NodeAfterSwap()
		rs, err = n.Status(ctx)
	}
	if err != nil {
		return nil, err
	}
	st := d.db.Stats()
	s := &admin.Status{
		Node:    admin.StatusNode{ID: replication.IDString(d.id.ID), Name: d.cfg.Node.Name, Version: version.Version},
		Role:    rs.Role,
		Term:    rs.Term,
		Members: []admin.StatusMember{},
		Log:     admin.StatusLog{FirstIndex: st.FirstIndex, LastIndex: st.LastIndex, CommitIndex: rs.Commit, AppliedIndex: st.Applied, CatchingUp: rs.CatchingUp, CatchUp: catchUpOf(rs)},
		Disk:    admin.StatusDisk{BudgetBytes: uint64(d.cfg.Storage.MaxBytes)},
		MQTT: admin.StatusMQTT{Clients: d.broker.Clients(), Inflight: d.broker.Inflight(),
			MemoryBytes: d.broker.MemoryUsed(), MemoryBudgetBytes: int64(d.cfg.Limits.Memory), HeldForMemory: d.broker.HeldForMemory()},
		Storage: admin.StatusStorage{Commits: d.db.Commits(), Fsyncs: d.db.Syncs(), Written: statusWritten(d.db.Written())},
		Cluster: admin.StatusCluster{ID: d.gw.ClusterID(), Generation: d.gw.Generation(), TopicsHash: d.gw.TopicsHash(), PeerAddrs: d.gw.PeerAddrs(), Requeued: n.Requeued(),
			FeatureLevel: n.FeatureLevel(), FeatureLevelKnown: storage.FeatureLevel},
	}
	rt := d.db.RetentionStats()
	s.Storage.UsedBytes, s.Storage.BudgetBytes = rt.UsedBytes, rt.BudgetBytes
	// The budget is the whole data dir's, so is what disk.used compares
	// with it.
	s.Disk.UsedBytes = rt.UsedBytes
	s.Storage.DroppedRecords = rt.Dropped
	if why := d.db.RefusingReason(); why != "" {
		// What the gateway did about it (replication/handoff.go).
		switch to, stuck := n.Handoff(); {
		case stuck != "":
			why += "; " + stuck
		case to != 0 && n.Leader() != n.ID():
			why += "; the mastership went to a member with space, which takes this gateway's publishes"
		}
		s.Storage.Refusing = &why
	}
	d.damageStatus(&s.Storage)
	sp := d.db.SpaceStats()
	s.Storage.FreeBytes, s.Storage.MinFreeBytes = sp.FreeBytes, sp.MinFreeBytes
	if !rt.Oldest.IsZero() {
		s.Storage.OldestAgeSeconds = max(0, clock.Now().Sub(rt.Oldest).Seconds())
	}
	if n, err := d.db.RequeuePending(); err == nil {
		s.Cluster.RequeuePending = n
	}
	names := map[uint64]string{d.id.ID: d.cfg.Node.Name}
	progress := map[uint64]replication.MemberProgress{}
	for _, p := range rs.Members {
		progress[p.ID] = p
	}
	now := clock.Now() // measured against record times
	for _, m := range n.Members() {
		if m.ID == d.id.ID {
			continue
		}
		if m.Name != "" {
			names[m.ID] = m.Name
		}
		sm := admin.StatusMember{ID: replication.IDString(m.ID), Name: m.Name, Voter: m.Voter, Role: "slave"}
		if len(m.Addrs) > 0 {
			sm.Addr = m.Addrs[0]
		}
		if m.ID == rs.Leader {
			sm.Role = "master"
		}
		sm.Reachable = d.gw.Reachable(m.ID)
		if t, ok := d.downSince(m.ID); ok && !sm.Reachable {
			sm.DownSince = &t
		}
		if level, build, ok := d.gw.PeerBuild(m.ID); ok {
			sm.Version, sm.FeatureLevel = build, level
		}
		if h := d.gw.TopicsOf(m.ID); h != "" {
			same := h == s.Cluster.TopicsHash
			sm.TopicsMatch = &same
		}
		// What the master knows of the others' logs; a slave reports none.
		if p, ok := progress[m.ID]; ok {
			sm.MatchIndex, sm.MatchKnown = p.Match, p.Match > 0
			if rs.Last > p.Match {
				sm.LagRecords = rs.Last - p.Match
				sm.LagSeconds = d.lagSeconds(p.Match, rs.Last, now)
			}
		}
		s.Members = append(s.Members, sm)
	}
	// The serving watch's finding, which /healthz reads too: the master
	// is named only while it is in reach.
	sv := d.servingNow()
	s.Serving = admin.ServingAll
	if sv.why != "" {
		why := sv.why
		s.Serving, s.NotServing = admin.ServingSubscribers, &why
		if ref, refused := d.broker.Redirecting(); ref != "" || refused != "" {
			s.Serving = admin.ServingNone
		}
	}
	// Named by the watch's rule, looked at now: a slave that just
	// joined names its master at once.
	if lead := d.reachableMaster(sv.why); lead != 0 {
		s.Leader = &admin.StatusNodeRef{ID: replication.IDString(lead), Name: names[lead]}
	}
	if open, exp := d.gw.PairState(); open {
		s.Pairing = admin.StatusPairing{Open: true, Expires: &exp}
	}
	var fs syscall.Statfs_t
	if syscall.Statfs(d.cfg.Node.DataDir, &fs) == nil {
		s.Disk.FreeBytes = uint64(fs.Bavail) * uint64(fs.Bsize)
	}
	s.Uplinks = d.ups.status()
	return s, nil
}

// lagSeconds is now minus the publish time of the oldest record after
// match: how far behind a member that holds the log up to match is.
func (d *Daemon) lagSeconds(match, last uint64, now time.Time) float64 {
	lo := match + 1
	if first, _ := d.db.FirstIndex(); lo < first {
		lo = first // retention dropped what lies before: the oldest kept
	}
	hi := min(last+1, lo+64)
	ents, err := d.db.Entries(lo, hi, 1<<20)
	if err != nil {
		return 0
	}
	for _, e := range ents {
		if e.Type != raftpb.EntryNormal || len(e.Data) == 0 {
			continue
		}
		rec, err := storage.DecodeRecord(e.Data)
		if err != nil || rec.Time == 0 {
			return 0
		}
		return max(0, now.Sub(time.Unix(0, rec.Time)).Seconds())
	}
	return 0
}

// statusWritten is the storage layer's written bytes as the status says
// them.
func statusWritten(w storage.Written) admin.StatusWritten {
	return admin.StatusWritten{WAL: w.WAL, Data: w.Data, Snapshot: w.Snapshot}
}

// catchUpOf is status's log.catch_up: null unless a catch-up is under way.
func catchUpOf(rs replication.Status) *admin.StatusCatchUp {
	if !rs.CatchingUp {
		return nil
	}
	return &admin.StatusCatchUp{RecordsPulled: rs.CatchUp.Records, BytesPulled: rs.CatchUp.Bytes, RecordsLeft: rs.CatchUp.Left}
}
