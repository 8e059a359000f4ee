package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"syscall"
	"time"

	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// Status is the status JSON of the contract (GET /v1/status, `tandem status
// --json`). Field names are stable; fields may be added.
type Status struct {
	Node    StatusNode     `json:"node"`
	Role    string         `json:"role"`
	Term    uint64         `json:"term"`
	Leader  *StatusNodeRef `json:"leader"`
	Members []StatusMember `json:"members"`
	Log     StatusLog      `json:"log"`
	Disk    StatusDisk     `json:"disk"`
	MQTT    StatusMQTT     `json:"mqtt"`
	Pairing StatusPairing  `json:"pairing"`
	Storage StatusStorage  `json:"storage"`
	Cluster StatusCluster  `json:"cluster"`
}

// StatusCluster names the cluster this gateway belongs to.
type StatusCluster struct {
	ID         string `json:"id"`
	Generation uint64 `json:"generation"`
	// TopicsHash is this gateway's topic rules hash; members whose
	// TopicsMatch is false have other rules.
	TopicsHash string   `json:"topics_hash"`
	PeerAddrs  []string `json:"peer_addrs"`
	// Requeued counts the records this node re-published since it
	// started; RequeuePending those still waiting to be.
	Requeued       uint64 `json:"requeued"`
	RequeuePending int    `json:"requeue_pending"`
}

// StatusNode identifies the gateway answering.
type StatusNode struct {
	ID      string `json:"id"`
	Name    string `json:"name"`
	Version string `json:"version"`
}

// StatusNodeRef names another node.
type StatusNodeRef struct {
	ID   string `json:"id"`
	Name string `json:"name"`
}

// StatusMember is one other member of the cluster.
type StatusMember struct {
	ID         string  `json:"id"`
	Name       string  `json:"name"`
	Addr       string  `json:"addr"`
	Role       string  `json:"role"`
	Voter      bool    `json:"voter"`
	Reachable  bool    `json:"reachable"`
	MatchIndex uint64  `json:"match_index"`
	LagRecords uint64  `json:"lag_records"`
	LagSeconds float64 `json:"lag_seconds"`
	// TopicsMatch is false when the member's topic rules differ from
	// this gateway's; nil while unknown.
	TopicsMatch *bool `json:"topics_match"`
}

// StatusLog gives the log's bounds.
type StatusLog struct {
	FirstIndex   uint64 `json:"first_index"`
	LastIndex    uint64 `json:"last_index"`
	CommitIndex  uint64 `json:"commit_index"`
	AppliedIndex uint64 `json:"applied_index"`
}

// StatusDisk gives the data file's use of the disk.
type StatusDisk struct {
	UsedBytes   int64  `json:"used_bytes"`
	FreeBytes   uint64 `json:"free_bytes"`
	BudgetBytes uint64 `json:"budget_bytes"`
}

// StatusMQTT counts the broker's clients.
type StatusMQTT struct {
	Clients  int64 `json:"clients"`
	Inflight int64 `json:"inflight"`
}

// StatusPairing says whether pairing is open.
type StatusPairing struct {
	Open    bool       `json:"open"`
	Expires *time.Time `json:"expires"`
}

// StatusStorage counts the durable writes of the log (WAL appends and
// checkpoints into the data file) and the fdatasyncs they cost.
//
// The rest is retention's view: UsedBytes is the whole data dir (WAL and
// data file), BudgetBytes storage.max_bytes, OldestAgeSeconds the age of the
// oldest record kept (0 when none), DroppedRecords what retention dropped
// since start, and Refusing is true while the log is over its budget with
// only records a member still lacks (or not yet applied) left to drop.
type StatusStorage struct {
	Commits          uint64  `json:"commits"`
	Fsyncs           uint64  `json:"fsyncs"`
	UsedBytes        int64   `json:"used_bytes"`
	BudgetBytes      int64   `json:"budget_bytes"`
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	DroppedRecords   uint64  `json:"dropped_records"`
	Refusing         bool    `json:"refusing"`
}

// status assembles the status JSON.
func (d *Daemon) status(ctx context.Context) (*Status, error) {
	n := d.node()
	rs, err := n.Status(ctx)
	if errors.Is(err, replication.ErrStopped) {
		// A join, rejoin or promotion is replacing the node: wait for
		// it (the swap holds swapMu) and ask the new one.
		d.swapMu.Lock()
		n = d.node()
		d.swapMu.Unlock()
		rs, err = n.Status(ctx)
	}
	if err != nil {
		return nil, err
	}
	st := d.db.Stats()
	s := &Status{
		Node:    StatusNode{ID: replication.IDString(d.id.ID), Name: d.cfg.Node.Name, Version: Version},
		Role:    rs.Role,
		Term:    rs.Term,
		Members: []StatusMember{},
		Log:     StatusLog{FirstIndex: st.FirstIndex, LastIndex: st.LastIndex, CommitIndex: rs.Commit, AppliedIndex: st.Applied},
		Disk:    StatusDisk{BudgetBytes: uint64(d.cfg.Storage.MaxBytes)},
		MQTT:    StatusMQTT{Clients: d.broker.Clients(), Inflight: d.broker.Inflight()},
		Storage: StatusStorage{Commits: d.db.Commits(), Fsyncs: d.db.Syncs()},
		Cluster: StatusCluster{ID: d.cl.clusterID(), Generation: d.cl.generation(), TopicsHash: d.topicsHash(), PeerAddrs: d.cl.myAddrs(), Requeued: n.Requeued()},
	}
	rt := d.db.RetentionStats()
	s.Storage.UsedBytes, s.Storage.BudgetBytes = rt.UsedBytes, rt.BudgetBytes
	// The budget is the whole data dir's, so is what disk.used compares
	// with it.
	s.Disk.UsedBytes = rt.UsedBytes
	s.Storage.DroppedRecords, s.Storage.Refusing = rt.Dropped, rt.Refusing
	if !rt.Oldest.IsZero() {
		s.Storage.OldestAgeSeconds = max(0, time.Since(rt.Oldest).Seconds())
	}
	if n, err := d.db.RequeuePending(); err == nil {
		s.Cluster.RequeuePending = n
	}
	names := map[uint64]string{d.id.ID: d.cfg.Node.Name}
	progress := map[uint64]replication.MemberProgress{}
	for _, p := range rs.Members {
		progress[p.ID] = p
	}
	now := time.Now()
	for _, m := range n.Members() {
		if m.ID == d.id.ID {
			continue
		}
		if m.Name != "" {
			names[m.ID] = m.Name
		}
		sm := StatusMember{ID: replication.IDString(m.ID), Name: m.Name, Voter: m.Voter, Role: "slave"}
		if len(m.Addrs) > 0 {
			sm.Addr = m.Addrs[0]
		}
		if m.ID == rs.Leader {
			sm.Role = "master"
		}
		sm.Reachable = d.cl.tr.Reachable(m.ID)
		if h := d.cl.topicsOf(m.ID); h != "" {
			same := h == s.Cluster.TopicsHash
			sm.TopicsMatch = &same
		}
		// What the master knows of the others' logs; a slave reports none.
		if p, ok := progress[m.ID]; ok {
			sm.MatchIndex = p.Match
			if rs.Last > p.Match {
				sm.LagRecords = rs.Last - p.Match
				sm.LagSeconds = d.lagSeconds(p.Match, rs.Last, now)
			}
		}
		s.Members = append(s.Members, sm)
	}
	if rs.Leader != 0 {
		s.Leader = &StatusNodeRef{ID: replication.IDString(rs.Leader), Name: names[rs.Leader]}
	}
	if open, exp := d.cl.pairState(); open {
		s.Pairing = StatusPairing{Open: true, Expires: &exp}
	}
	var fs syscall.Statfs_t
	if syscall.Statfs(d.cfg.Node.DataDir, &fs) == nil {
		s.Disk.FreeBytes = uint64(fs.Bavail) * uint64(fs.Bsize)
	}
	return s, nil
}

func (d *Daemon) handleStatus(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	s, err := d.status(ctx)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(s)
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
