package admin

import (
	"time"

	"github.com/tandem-edge/tandem/uplink"
)

// Status is the status JSON of the contract (GET /v1/status, `tandem status
// --json`). Field names are stable; fields may be added.
type Status struct {
	Node StatusNode `json:"node"`
	Role string     `json:"role"`
	Term uint64     `json:"term"`
	// Serving is ServingAll while this member takes publishes (/healthz
	// answers 200), ServingSubscribers while it does not but keeps its
	// devices, and ServingNone while it sends them to another member or
	// refuses them; NotServing is then why, the /healthz 503 body word
	// for word (null while it takes them).
	Serving    string  `json:"serving"`
	NotServing *string `json:"not_serving"`
	// Leader is the master while this member is it or reaches it, null
	// while none is in reach (a dead master is not named).
	Leader  *StatusNodeRef `json:"leader"`
	Members []StatusMember `json:"members"`
	Log     StatusLog      `json:"log"`
	Disk    StatusDisk     `json:"disk"`
	MQTT    StatusMQTT     `json:"mqtt"`
	Pairing StatusPairing  `json:"pairing"`
	Storage StatusStorage  `json:"storage"`
	Cluster StatusCluster  `json:"cluster"`
	// Uplinks is every configured uplink's state, in config order; only
	// the master's are running.
	Uplinks []uplink.Status `json:"uplinks"`
}

// The values of Status.Serving.
const (
	ServingAll         = "publishes and subscribers"
	ServingSubscribers = "subscribers only"
	// ServingNone: devices are sent to another member or refused (a
	// member cut off from the majority, or whose broker state is
	// incomplete).
	ServingNone = "no devices"
)

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
	// FeatureLevel is the cluster's feature level as this member applied
	// it, FeatureLevelKnown the highest this build knows: the master
	// raises the first to the second once every member's build knows it
	// (docs/install.md, "Rolling upgrades and the feature level").
	FeatureLevel      int `json:"feature_level"`
	FeatureLevelKnown int `json:"feature_level_known"`
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
	ID        string `json:"id"`
	Name      string `json:"name"`
	Addr      string `json:"addr"`
	Role      string `json:"role"`
	Voter     bool   `json:"voter"`
	Reachable bool   `json:"reachable"`
	// MatchIndex is how much of the log the member holds, as the master
	// knows it; MatchKnown is false where it is not known (on a slave,
	// which hears only from the master, or for a member the master has
	// not heard from): MatchIndex and the lags are then 0.
	MatchIndex uint64  `json:"match_index"`
	MatchKnown bool    `json:"match_known"`
	LagRecords uint64  `json:"lag_records"`
	LagSeconds float64 `json:"lag_seconds"`
	// DownSince is when this gateway lost its link to the member, null
	// while it has one (or, on a slave, for another slave it needs none
	// with).
	DownSince *time.Time `json:"down_since"`
	// TopicsMatch is false when the member's topic rules differ from
	// this gateway's; nil while unknown.
	TopicsMatch *bool `json:"topics_match"`
	// Version is the member's release and FeatureLevel the highest
	// feature level its build knows, as its latest peer hello said; ""
	// and 0 while no link was made (or from a build before they were
	// sent: version "", level 1).
	Version      string `json:"version"`
	FeatureLevel int    `json:"feature_level"`
}

// StatusLog gives the log's bounds.
type StatusLog struct {
	FirstIndex   uint64 `json:"first_index"`
	LastIndex    uint64 `json:"last_index"`
	CommitIndex  uint64 `json:"commit_index"`
	AppliedIndex uint64 `json:"applied_index"`
	// CatchingUp is true while this member, which installed a snapshot,
	// pulls the records before it from the master; CatchUp says how far
	// it got (null otherwise).
	CatchingUp bool           `json:"catching_up"`
	CatchUp    *StatusCatchUp `json:"catch_up"`
}

// StatusCatchUp is the progress of a catch-up after a snapshot.
type StatusCatchUp struct {
	RecordsPulled uint64 `json:"records_pulled"`
	BytesPulled   uint64 `json:"bytes_pulled"`
	// RecordsLeft is -1 until the master has answered once.
	RecordsLeft int64 `json:"records_left"`
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
	// MemoryBytes is what clients make the gateway hold now, charged to
	// limits.memory (MemoryBudgetBytes); HeldForMemory the connections
	// not read from meanwhile.
	MemoryBytes       int64 `json:"memory_bytes"`
	MemoryBudgetBytes int64 `json:"memory_budget_bytes"`
	HeldForMemory     int64 `json:"held_for_memory"`
}

// StatusWritten is the bytes the storage layer wrote since the start, by
// file: the pages each WAL fdatasync covered, the pages the data file's
// commits wrote, and the snapshot bodies built for members behind. The
// device writes more (the file system's journal and metadata); its own
// counters show the difference.
type StatusWritten struct {
	WAL      int64 `json:"wal"`
	Data     int64 `json:"data"`
	Snapshot int64 `json:"snapshot"`
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
// since start, and Refusing is null while the gateway takes publishes, else
// why it refuses them: free space below storage.min_free, or the log over
// its budget with only records a member still lacks left to drop.
// FreeBytes and MinFreeBytes are the watermark's last reading.
type StatusStorage struct {
	Commits          uint64  `json:"commits"`
	Fsyncs           uint64  `json:"fsyncs"`
	UsedBytes        int64   `json:"used_bytes"`
	BudgetBytes      int64   `json:"budget_bytes"`
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	DroppedRecords   uint64  `json:"dropped_records"`
	Refusing         *string `json:"refusing"`
	FreeBytes        int64   `json:"free_bytes"`
	MinFreeBytes     int64   `json:"min_free_bytes"`
	// Lost are the log index ranges of records this member held alone
	// when its data file was found damaged and that the cluster could not
	// give back (storage.on_damage: resync); empty when none.
	Lost []StatusRange `json:"lost"`
	// Damaged is null unless this member's data file failed its checks at
	// a start and was moved aside: where to, and the re-sync's state.
	Damaged *StatusDamaged `json:"damaged"`
	// Written is what the storage layer wrote into the data dir since
	// the start, by file.
	Written StatusWritten `json:"written_bytes"`
}

// StatusRange is the log indexes First..Last, both included.
type StatusRange struct {
	First uint64 `json:"first"`
	Last  uint64 `json:"last"`
}

// StatusDamaged describes the damaged data file a member moved aside: the
// directory it went to, when, what could not be read of it, and whether
// the member is still re-syncing from the master.
type StatusDamaged struct {
	Dir   string    `json:"dir"`
	At    time.Time `json:"at"`
	Error string    `json:"error"`
	// Opened is false when nothing of the damaged file could be read:
	// Unreadable is then empty and the extent of the damage unknown.
	Opened     bool          `json:"opened"`
	Unreadable []StatusRange `json:"unreadable"`
	Resyncing  bool          `json:"resyncing"`
}

// LostRecords counts the records in Lost.
func (s StatusStorage) LostRecords() uint64 {
	var n uint64
	for _, r := range s.Lost {
		n += r.Last - r.First + 1
	}
	return n
}

// IsRefusing reports whether the storage refuses publishes.
func (s StatusStorage) IsRefusing() bool { return s.Refusing != nil }
