package admin

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/version"
	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/replication"

	"github.com/tandem-edge/tandem/internal/clock"
)

// Ack outcomes, the "outcome" label of tandem_mqtt_acks_sent_total. An enum
// rather than strings so the hot path indexes an array of counters.
const (
	outcomeOK = iota
	outcomeTimeout
	outcomeQuota
	outcomeNotAuthorized
	outcomeNotMaster
	outcomeError
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"ok", "timeout", "quota_exceeded", "not_authorized", "not_master", "error"}

// ackOutcome classifies why a publish was not acked; only failures pay for
// the errors.Is walk.
func ackOutcome(err error) int {
	switch {
	case err == nil:
		return outcomeOK
	case errors.Is(err, replication.ErrAckTimeout):
		return outcomeTimeout
	case errors.Is(err, mqtt.ErrQuota):
		return outcomeQuota
	case errors.Is(err, mqtt.ErrNotAuthorized):
		return outcomeNotAuthorized
	case errors.Is(err, replication.ErrNotLeader):
		return outcomeNotMaster
	}
	return outcomeError
}

// maxRuleCounts bounds the topic rules whose publishes are counted one by
// one for the status page; rules past it only count in the totals.
const maxRuleCounts = 64

// slowFsync is the commit duration past which the disk is worth a log
// line; slowFsyncEvery bounds those lines, so a dying SD card gives one
// line per interval, not one per commit.
const (
	slowFsync      = time.Second
	slowFsyncEvery = 30 * time.Second
)

// FieldView is the gateway's field view: the Prometheus registry, the hot
// path's counters (it is the broker's mqtt.Observer and the storage's
// OnCommit), and the history the status page draws. The daemon makes one
// while it starts, before the storage and the broker, which report to it
// from their first commit and publish.
type FieldView struct {
	gw  Gateway
	cfg *config.Config // as started: the node's name and peer address
	log *slog.Logger
	reg *prometheus.Registry

	// Children resolved once, so the hot path does no label lookup:
	// published[ack mode][qos], acked[ack mode][outcome], ackLatency[ack mode].
	published  [2][3]prometheus.Counter
	acked      [2][numOutcomes]prometheus.Counter
	ackLatency [2]prometheus.Observer
	refused    *prometheus.CounterVec // by the mqtt layer's reason
	// httpRefusedBy counts the HTTP listener's refused connections, by
	// reason (connlimit.go's).
	httpRefusedBy map[string]prometheus.Counter
	// sessionDropped counts log positions retention took before a
	// session was handed them.
	sessionDropped prometheus.Counter
	// syncInDoubt counts sync records confirmed without their outcome
	// known (an earlier master logged them and never settled them).
	syncInDoubt prometheus.Counter
	// recordsSkipped counts the records the applier skipped, by kind.
	recordsSkipped *prometheus.CounterVec
	fsync          prometheus.Observer
	batch          prometheus.Observer

	// ruleCounts[i+1] counts the publishes that topic rule i matched,
	// ruleCounts[0] those no rule matched; acksOK counts acks sent. Plain
	// atomics the sampler reads for rates.
	ruleCounts [maxRuleCounts + 1]atomic.Uint64
	acksOK     atomic.Uint64

	fsyncSeen  atomic.Bool  // a commit was reported: the storage is wired to us
	slowCount  atomic.Int64 // slow commits since the last slow-fsync line
	slowLogged atomic.Int64 // unix nanos of the last slow-fsync line

	hist *history

	startOnce sync.Once
	stopOnce  sync.Once
	stopc     chan struct{}
	wg        sync.WaitGroup
}

// NewFieldView makes the field view of the gateway gw started with cfg.
// gw is read only at scrapes, page views and samples, so it may be still
// starting when NewFieldView is called.
func NewFieldView(gw Gateway, cfg *config.Config, log *slog.Logger) *FieldView {
	fv := &FieldView{gw: gw, cfg: cfg, log: log, reg: prometheus.NewRegistry(), hist: newHistory(historySize), stopc: make(chan struct{})}
	published := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tandem_mqtt_publishes_received_total",
		Help: "PUBLISH packets taken into the log by this gateway, by the topic's ack mode and the QoS.",
	}, []string{"ack", "qos"})
	acked := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tandem_mqtt_acks_sent_total",
		Help: "PUBACKs and PUBRECs for publishes taken by this gateway, by ack mode and outcome (ok, or why the publish was refused).",
	}, []string{"ack", "outcome"})
	latency := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tandem_mqtt_ack_latency_seconds",
		Help:    "Time from a PUBLISH being read to its successful PUBACK/PUBREC being written, by ack mode.",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
	}, []string{"ack"})
	fsync := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "tandem_storage_fsync_duration_seconds",
		Help:    "Time bbolt takes to write and fdatasync one commit of the data file.",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
	})
	batch := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "tandem_storage_commit_entries",
		Help:    "Log entries per commit of the data file (group commit: one fsync for the batch); commits of metadata only are not counted.",
		Buckets: prometheus.ExponentialBuckets(1, 2, 13), // 1 … 4096
	})
	for _, m := range []mqtt.AckMode{mqtt.Async, mqtt.Sync} {
		for q := range 3 {
			fv.published[m][q] = published.WithLabelValues(m.String(), string(rune('0'+q)))
		}
		for o := range numOutcomes {
			fv.acked[m][o] = acked.WithLabelValues(m.String(), outcomeNames[o])
		}
		fv.ackLatency[m] = latency.WithLabelValues(m.String())
	}
	fv.fsync, fv.batch = fsync, batch
	build := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "tandem_build_info",
		Help:        "Always 1; the labels give the version running.",
		ConstLabels: prometheus.Labels{"version": version.Version, "commit": version.Commit, "goversion": runtime.Version()},
	})
	build.Set(1)
	fv.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tandem_mqtt_refused_total",
		Help: "Clients, packets and subscriptions the MQTT listener refused, by reason (rate limits, bad logins, ACLs, limits, protocol errors).",
	}, []string{"reason"})
	httpRefused := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tandem_http_refused_total",
		Help: "Connections the HTTP API refused (answered 503 or closed at accept), by reason: over http.max_conns_per_address or http.max_conns.",
	}, []string{"reason"})
	fv.httpRefusedBy = map[string]prometheus.Counter{}
	for _, r := range []string{refusedHTTPAddr, refusedHTTPTotal} {
		fv.httpRefusedBy[r] = httpRefused.WithLabelValues(r)
	}
	fv.sessionDropped = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tandem_session_dropped_messages_total",
		Help: "Log positions that retention dropped before a persistent session was handed them: an upper bound of the messages sessions lost by falling further behind than the budget.",
	})
	fv.syncInDoubt = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tandem_sync_in_doubt_total",
		Help: "Sync records this gateway delivered on a new master's word alone: the master that logged them failed before logging whether their ack rule was met, so their publishers may have been refused.",
	})
	fv.recordsSkipped = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tandem_records_skipped_total",
		Help: "Records the applier could not read or apply and skipped, by kind (message, settle, session, cursors, uplinks, unreadable, or a kind this build does not know); every member skips the same ones and goes on serving.",
	}, []string{"kind"})
	fv.reg.MustRegister(published, acked, latency, fsync, batch, build, fv.refused, httpRefused, fv.sessionDropped, fv.syncInDoubt, fv.recordsSkipped, statusCollector{fv},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return fv
}

// Published implements mqtt.Observer.
func (fv *FieldView) Published(mode mqtt.AckMode, qos byte, rule int) {
	fv.published[mode&1][min(qos, 2)].Inc()
	if r := uint(rule + 1); r < uint(len(fv.ruleCounts)) {
		fv.ruleCounts[r].Add(1)
	}
}

// Dropped implements mqtt.Observer.
func (fv *FieldView) Dropped(n uint64) { fv.sessionDropped.Add(float64(n)) }

// InDoubt implements mqtt.Observer.
func (fv *FieldView) InDoubt(n uint64) { fv.syncInDoubt.Add(float64(n)) }

// RegisterMemory adds the memory account's gauges: tandem_memory_bytes
// (what clients make the gateway hold), tandem_memory_budget_bytes
// (limits.memory) and tandem_memory_held_connections (not read from for
// it now).
func (fv *FieldView) RegisterMemory(used, held func() int64, budget int64) {
	fv.reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tandem_memory_bytes", Help: "Bytes clients make the gateway hold now (publishes waiting for the log and what is kept for each client), charged to limits.memory."}, func() float64 { return float64(used()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tandem_memory_budget_bytes", Help: "limits.memory: near it the connections holding the most are not read from; at it publishes are refused with 0x97."}, func() float64 { return float64(budget) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tandem_memory_held_connections", Help: "Connections not read from now because they, or the gateway, hold too much of limits.memory (TCP back-pressure)."}, func() float64 { return float64(held()) }),
	)
}

// RegisterBrokerState adds the gauges of the broker's capped state: the
// retained messages (mqtt.max_retained), the bytes they count
// (mqtt.max_retained_bytes) and the persistent sessions (mqtt.max_sessions).
func (fv *FieldView) RegisterBrokerState(retained, retainedBytes, sessions func() int64) {
	fv.reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tandem_retained_messages", Help: "Topics with a retained message; past mqtt.max_retained a new one is refused with 0x97."}, func() float64 { return float64(retained()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tandem_retained_bytes", Help: "Bytes the retained messages take in the data file, as counted against mqtt.max_retained_bytes."}, func() float64 { return float64(retainedBytes()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tandem_sessions_persistent", Help: "Persistent sessions held, online or not, the other members' included; past mqtt.max_sessions a new one is refused with 0x97."}, func() float64 { return float64(sessions()) }),
	)
}

// RegisterSessionBytes adds tandem_session_bytes: what the persistent
// sessions count against mqtt.max_session_bytes.
func (fv *FieldView) RegisterSessionBytes(bytes func() int64) {
	fv.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tandem_session_bytes",
		Help: "Bytes the persistent sessions (the other members' included) keep in the data file, as counted against mqtt.max_session_bytes; past it a new session or filter is refused with 0x97."},
		func() float64 { return float64(bytes()) }))
}

// RegisterQoS0Dropped adds tandem_mqtt_qos0_dropped_total: QoS 0 messages
// subscribers did not take, past their queue's bounds (dropped reads the
// broker's count).
func (fv *FieldView) RegisterQoS0Dropped(dropped func() uint64) {
	fv.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tandem_mqtt_qos0_dropped_total",
		Help: "QoS 0 messages dropped for subscribers that read slower than they came (past mqtt.max_queued or mqtt.max_queued_bytes, or while catching up from the log); QoS 0 is never read back from the log."},
		func() float64 { return float64(dropped()) }))
}

// RecordSkipped counts a record the applier skipped, of kind.
func (fv *FieldView) RecordSkipped(kind string) { fv.recordsSkipped.WithLabelValues(kind).Inc() }

// Refused implements mqtt.Observer.
func (fv *FieldView) Refused(reason string) { fv.refused.WithLabelValues(reason).Inc() }

// httpRefused counts a connection the HTTP listener refused.
func (fv *FieldView) httpRefused(reason string) {
	if c := fv.httpRefusedBy[reason]; c != nil {
		c.Inc()
	}
}

// Acked implements mqtt.Observer. Only successful acks go into the latency
// histogram: a refusal's latency is sync_timeout or nothing, and would hide
// how fast acks really are; refusals are counted by outcome.
func (fv *FieldView) Acked(mode mqtt.AckMode, err error, latency time.Duration) {
	o := ackOutcome(err)
	fv.acked[mode&1][o].Inc()
	if o == outcomeOK {
		fv.ackLatency[mode&1].Observe(latency.Seconds())
		fv.acksOK.Add(1)
	}
}

// OnCommit is the storage's OnCommit: fsync latency, batch size, and a
// rate-limited warning when the disk is slow.
func (fv *FieldView) OnCommit(sync time.Duration, entries int) {
	fv.fsync.Observe(sync.Seconds())
	if !fv.fsyncSeen.Load() {
		fv.fsyncSeen.Store(true)
	}
	if entries > 0 {
		fv.batch.Observe(float64(entries))
	}
	if sync < slowFsync {
		return
	}
	n := fv.slowCount.Add(1)
	now := int64(clock.Mono()) // a jump back of the wall clock must not mute it
	last := fv.slowLogged.Load()
	if (last != 0 && now-last < int64(slowFsyncEvery)) || !fv.slowLogged.CompareAndSwap(last, now) {
		return
	}
	fv.slowCount.Add(-n)
	fv.log.Warn("slow fsync: the disk took long to make a commit durable; acks wait for it",
		"duration", sync.Round(time.Millisecond), "entries", entries, "slow_commits", n, "within", slowFsyncEvery)
}

// Wired reports whether both the storage (a commit) and the broker (a
// publish) have reported to the field view: a daemon that forgot to hand
// it over would ship without its hot-path metrics.
func (fv *FieldView) Wired() bool {
	if !fv.fsyncSeen.Load() {
		return false
	}
	for i := range fv.ruleCounts {
		if fv.ruleCounts[i].Load() > 0 {
			return true
		}
	}
	return false
}

// metricsHandler serves the registry in the Prometheus text format. It
// goes on with what it has when one collector fails, so a status that
// times out does not blank the hot-path counters.
func (fv *FieldView) metricsHandler() http.Handler {
	return promhttp.HandlerFor(fv.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError, Registry: fv.reg})
}

// statusCollector reads the gauges that describe state from the status
// JSON at scrape time, so they cannot drift from what /v1/status says.
type statusCollector struct{ fv *FieldView }

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(name, help, labels, nil)
}

var (
	descNode          = desc("tandem_node_info", "Always 1; the labels name this gateway.", "id", "name")
	descTerm          = desc("tandem_raft_term", "This node's raft term.")
	descRole          = desc("tandem_raft_role", "1 for this node's role (master, slave, candidate), 0 for the others.", "role")
	descLeaderChanges = desc("tandem_raft_leader_changes_total", "Times this node saw the master change (to another node or to none) since it started.")
	descHasLeader     = desc("tandem_raft_has_leader", "1 when this node knows a master.")
	descMembers       = desc("tandem_cluster_members", "Members of the cluster, this node included.")
	descLagRecords    = desc("tandem_replication_lag_records", "Records the member lacks of the master's log, as the master sees it.", "peer", "peer_id")
	descLagSeconds    = desc("tandem_replication_lag_seconds", "Age of the oldest record the member lacks (0 when it lacks none).", "peer", "peer_id")
	descMatchIndex    = desc("tandem_replication_match_index", "Last log index the master knows the member holds.", "peer", "peer_id")
	descReachable     = desc("tandem_peer_reachable", "1 when the master hears from the member.", "peer", "peer_id")
	descVoter         = desc("tandem_peer_voter", "1 when the member votes, 0 for a learner (the slave of a 2-gateway cluster).", "peer", "peer_id")
	descFirstIndex    = desc("tandem_log_first_index", "First index in the local log.")
	descLastIndex     = desc("tandem_log_last_index", "Last index in the local log.")
	descCommitIndex   = desc("tandem_log_commit_index", "Highest log index known committed.")
	descAppliedIndex  = desc("tandem_log_applied_index", "Highest log index applied (delivered to subscribers).")
	descDiskUsed      = desc("tandem_disk_used_bytes", "Size of the data dir (WAL and data file), as tandem_storage_used_bytes.")
	descDiskFree      = desc("tandem_disk_free_bytes", "Free space on the data dir's file system, for unprivileged users.")
	descDiskBudget    = desc("tandem_disk_budget_bytes", "storage.max_bytes, 0 when unset.")
	descCommits       = desc("tandem_storage_commits_total", "Durable writes of the log: WAL appends (one fdatasync) and checkpoints into the data file (two).")
	descFsyncs        = desc("tandem_storage_fsyncs_total", "fdatasyncs of the WAL and the data file.")
	descWritten       = desc("tandem_storage_written_bytes_total", "Bytes the storage layer wrote into the data dir, by file: wal (the pages each fdatasync covered), data (the pages the data file's commits wrote), snapshot (snapshots built for members behind). The device writes more: the file system's journal and metadata.", "file")
	descStoreUsed     = desc("tandem_storage_used_bytes", "Size of the whole data dir: WAL and data file.")
	descStoreBudget   = desc("tandem_storage_budget_bytes", "storage.max_bytes: the data dir's budget (plus a 2MiB slack).")
	descStoreDropped  = desc("tandem_storage_dropped_records_total", "Records retention dropped (max_bytes, max_age) since the start.")
	descStoreOldest   = desc("tandem_storage_oldest_record_age_seconds", "Age of the oldest record in the log; 0 when it holds none.")
	descStoreRefusing = desc("tandem_storage_refusing", "1 while publishes are refused: free space below storage.min_free, or the log over its budget with only records a member still lacks left.")
	descStoreFree     = desc("tandem_storage_free_bytes", "Free space on the data dir's filesystem at the last reading (-1 before one).")
	descStoreMinFree  = desc("tandem_storage_min_free_bytes", "storage.min_free: below it publishes are refused.")
	descStoreLost     = desc("tandem_storage_lost_records_total", "Records this member held alone when its data file was found damaged that the cluster could not give back (storage.lost in status).")
	descClients       = desc("tandem_mqtt_clients_connected", "MQTT clients connected to this gateway.")
	descInflight      = desc("tandem_mqtt_inflight_messages", "QoS 1/2 messages in flight between this gateway and its clients.")
	descRetained      = desc("tandem_mqtt_retained_messages", "Retained messages this gateway holds.")
	descStatusUp      = desc("tandem_status_up", "1 when the status could be read for this scrape; the state metrics are missing when 0.")
	descGeneration    = desc("tandem_cluster_generation", "The cluster generation: raised by each promotion (tandem promote, failover: auto).")
	descPromotions    = desc("tandem_promotions_total", "Times this gateway promoted itself to master since it started.")
	descDeposed       = desc("tandem_deposed_total", "Times this gateway found it had been replaced as master and rejoined as slave, since it started.")
	descRequeued      = desc("tandem_requeued_records_total", "Records set aside (a deposed master's tail, or --requeue) that this node re-published since its replication last started.")
	descRequeuePend   = desc("tandem_requeue_pending_records", "Records set aside and not yet re-published.")
	descTopicsMatch   = desc("tandem_peer_topic_rules_match", "1 when the member's topic rules hash equals this gateway's, 0 when they differ (absent while unknown).", "peer", "peer_id")
)

var roles = [...]string{"master", "slave", "candidate"}

// Describe implements prometheus.Collector.
func (statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descNode, descTerm, descRole, descLeaderChanges, descHasLeader, descMembers,
		descLagRecords, descLagSeconds, descMatchIndex, descReachable, descVoter,
		descFirstIndex, descLastIndex, descCommitIndex, descAppliedIndex,
		descDiskUsed, descDiskFree, descDiskBudget, descCommits, descFsyncs, descWritten,
		descStoreUsed, descStoreBudget, descStoreDropped, descStoreOldest, descStoreRefusing, descStoreFree, descStoreMinFree, descStoreLost, descClients, descInflight, descRetained, descStatusUp,
		descGeneration, descPromotions, descDeposed, descRequeued, descRequeuePend, descTopicsMatch} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c statusCollector) Collect(ch chan<- prometheus.Metric) {
	gw := c.fv.gw
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s, err := gw.Status(ctx)
	if err != nil {
		c.fv.log.Debug("metrics: status unavailable", "error", err)
		ch <- gauge(descStatusUp, 0)
		return
	}
	ch <- gauge(descStatusUp, 1)
	ch <- gauge(descNode, 1, s.Node.ID, s.Node.Name)
	ch <- gauge(descTerm, float64(s.Term))
	for _, r := range roles {
		ch <- gauge(descRole, b2f(s.Role == r), r)
	}
	ch <- gauge(descHasLeader, b2f(s.Leader != nil))
	if n, err := gw.LeaderChanges(ctx); err == nil {
		ch <- prometheus.MustNewConstMetric(descLeaderChanges, prometheus.CounterValue, float64(n))
	}
	ch <- gauge(descMembers, float64(1+len(s.Members)))
	for _, m := range s.Members {
		ch <- gauge(descLagRecords, float64(m.LagRecords), m.Name, m.ID)
		ch <- gauge(descLagSeconds, m.LagSeconds, m.Name, m.ID)
		ch <- gauge(descMatchIndex, float64(m.MatchIndex), m.Name, m.ID)
		ch <- gauge(descReachable, b2f(m.Reachable), m.Name, m.ID)
		ch <- gauge(descVoter, b2f(m.Voter), m.Name, m.ID)
		if m.TopicsMatch != nil {
			ch <- gauge(descTopicsMatch, b2f(*m.TopicsMatch), m.Name, m.ID)
		}
	}
	ch <- gauge(descGeneration, float64(s.Cluster.Generation))
	ch <- prometheus.MustNewConstMetric(descPromotions, prometheus.CounterValue, float64(gw.Promotions()))
	ch <- prometheus.MustNewConstMetric(descDeposed, prometheus.CounterValue, float64(gw.Depositions()))
	ch <- prometheus.MustNewConstMetric(descRequeued, prometheus.CounterValue, float64(s.Cluster.Requeued))
	ch <- gauge(descRequeuePend, float64(s.Cluster.RequeuePending))
	ch <- gauge(descFirstIndex, float64(s.Log.FirstIndex))
	ch <- gauge(descLastIndex, float64(s.Log.LastIndex))
	ch <- gauge(descCommitIndex, float64(s.Log.CommitIndex))
	ch <- gauge(descAppliedIndex, float64(s.Log.AppliedIndex))
	ch <- gauge(descDiskUsed, float64(s.Disk.UsedBytes))
	ch <- gauge(descDiskFree, float64(s.Disk.FreeBytes))
	ch <- gauge(descDiskBudget, float64(s.Disk.BudgetBytes))
	ch <- prometheus.MustNewConstMetric(descCommits, prometheus.CounterValue, float64(s.Storage.Commits))
	ch <- prometheus.MustNewConstMetric(descFsyncs, prometheus.CounterValue, float64(s.Storage.Fsyncs))
	w := s.Storage.Written
	ch <- prometheus.MustNewConstMetric(descWritten, prometheus.CounterValue, float64(w.WAL), "wal")
	ch <- prometheus.MustNewConstMetric(descWritten, prometheus.CounterValue, float64(w.Data), "data")
	ch <- prometheus.MustNewConstMetric(descWritten, prometheus.CounterValue, float64(w.Snapshot), "snapshot")
	ch <- gauge(descStoreUsed, float64(s.Storage.UsedBytes))
	ch <- gauge(descStoreBudget, float64(s.Storage.BudgetBytes))
	ch <- prometheus.MustNewConstMetric(descStoreDropped, prometheus.CounterValue, float64(s.Storage.DroppedRecords))
	ch <- gauge(descStoreOldest, s.Storage.OldestAgeSeconds)
	ch <- gauge(descStoreRefusing, b2f(s.Storage.IsRefusing()))
	ch <- gauge(descStoreFree, float64(s.Storage.FreeBytes))
	ch <- gauge(descStoreMinFree, float64(s.Storage.MinFreeBytes))
	ch <- prometheus.MustNewConstMetric(descStoreLost, prometheus.CounterValue, float64(s.Storage.LostRecords()))
	ch <- gauge(descClients, float64(s.MQTT.Clients))
	ch <- gauge(descInflight, float64(s.MQTT.Inflight))
	ch <- gauge(descRetained, float64(gw.Retained()))
}

func gauge(d *prometheus.Desc, v float64, labels ...string) prometheus.Metric {
	return prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
