package daemon

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
	"github.com/tandem-edge/tandem/uplink"

	"github.com/tandem-edge/tandem/internal/clock"
)

// The uplinks of `uplinks:` and what plugs them into the gateway: the log
// they read (uplinkLog), the replicated positions (KindUplinks records,
// kept by every member in bucketUplinks), the master-only lifecycle (a
// role watcher), the retention hold and the local publish path of their
// downlinks.

// Uplink positions travel as control records of storage.KindUplinks: a
// JSON object name → index. Like session cursors, they are replicated in
// batches, and every member keeps the highest position per name, so the
// next master resumes there.

// bucketUplinks holds the replicated positions, by uplink name (8 bytes,
// big-endian), staged so they commit with the log they describe;
// bucketPaused the uplinks `tandem uplink pause` holds back (name → 1).
const (
	bucketUplinks = "uplinks"
	bucketPaused  = "uplinks-paused"
)

// pauseClient marks a KindUplinks record that pauses or resumes an
// uplink (pauseOp) rather than carrying positions: a pause holds on
// every member, so it outlives a failover and a restart, and may be
// asked of any member.
const pauseClient = "pause"

// pauseOp is the payload of a pause record.
type pauseOp struct {
	Name   string `json:"name"`
	Paused bool   `json:"paused"`
}

// roleEvery is how often the role watcher looks whether this member is
// the master.
const roleEvery = 50 * time.Millisecond

// uplinks runs the configured uplinks on the master.
type uplinks struct {
	d    *Daemon
	log  *slog.Logger
	list []*uplink.Uplink
	cfgs []uplink.Config

	mu  sync.Mutex
	pos map[string]uint64 // the replicated positions, as applied here
	// done and proposed are, per uplink, its forwarded + dropped + lost
	// count and its position when its position was last proposed
	// (positionSink).
	done, proposed map[string]uint64

	// gateMu guards gates: per uplink (as list), the notifications held
	// back from a sync record it forwards, not yet settled, on. The
	// applier fills and drains them; watch reads where they start.
	gateMu sync.Mutex
	gates  [][]upNote

	stopc chan struct{}
	wg    sync.WaitGroup
}

// upNote is one notification held back from an uplink.
type upNote struct {
	index uint64
	topic string
	size  int
	sync  bool
}

// newUplinks makes the uplinks of the config (none: nil) and loads their
// replicated positions.
func newUplinks(d *Daemon) (*uplinks, error) {
	c := d.cfg
	if len(c.Uplinks) == 0 {
		return nil, nil
	}
	us := &uplinks{d: d, log: d.log.With("component", "uplink"), pos: map[string]uint64{}, done: map[string]uint64{}, proposed: map[string]uint64{}, stopc: make(chan struct{})}
	if err := us.loadPositions(); err != nil {
		return nil, err
	}
	for _, uc := range c.Uplinks {
		cfg := uc.Uplink(c.Storage)
		u, err := uplink.New(cfg, uplink.Deps{
			Log:       uplinkLog{d.db, d},
			Positions: positionSink{d, us},
			Filters:   config.UplinkFilters,
			Local:     localPublisher{d: d, name: cfg.Name},
			Logger:    us.log,
		})
		if err != nil {
			return nil, config.UsageError{Err: err}
		}
		us.list = append(us.list, u)
		us.cfgs = append(us.cfgs, cfg)
	}
	if err := us.loadPauses(); err != nil {
		return nil, err
	}
	us.setHold()
	return us, nil
}

// loadPositions reads the replicated positions from the data file.
func (us *uplinks) loadPositions() error {
	pos := map[string]uint64{}
	err := us.d.db.ForEach(bucketUplinks, "", func(k, v []byte) error {
		if len(v) == 8 {
			pos[string(k)] = binary.BigEndian.Uint64(v)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("uplink positions: %w", err)
	}
	us.mu.Lock()
	us.pos = pos
	us.mu.Unlock()
	return nil
}

// loadPauses pauses the uplinks the data file says are paused, and
// resumes the others.
func (us *uplinks) loadPauses() error {
	paused := map[string]bool{}
	if err := us.d.db.ForEach(bucketPaused, "", func(k, _ []byte) error { paused[string(k)] = true; return nil }); err != nil {
		return fmt.Errorf("uplink pauses: %w", err)
	}
	for _, u := range us.list {
		if paused[u.Name()] {
			u.Pause()
		} else {
			u.Resume()
		}
	}
	return nil
}

// restore takes in the positions and pauses of a snapshot that replaced
// the data file's (applier.Restore); the uplinks run only on the master,
// which never installs one, so none is running.
func (us *uplinks) restore() error {
	if us == nil {
		return nil
	}
	if err := us.loadPositions(); err != nil {
		return err
	}
	if err := us.loadPauses(); err != nil {
		return err
	}
	us.setHold()
	return nil
}

// start launches the role watcher: the uplinks run while this member is
// the master.
func (us *uplinks) start() {
	if us == nil {
		return
	}
	us.wg.Add(1)
	go us.watch()
}

// stop ends the watcher and every uplink (each saves its position a last
// time, while replication still runs).
func (us *uplinks) stop() {
	if us == nil {
		return
	}
	close(us.stopc)
	us.wg.Wait()
	for _, u := range us.list {
		u.Stop()
	}
}

// watch starts the uplinks when this member becomes the master and stops
// them when it is no longer.
func (us *uplinks) watch() {
	defer us.wg.Done()
	t := time.NewTicker(roleEvery)
	defer t.Stop()
	running := false
	for {
		select {
		case <-us.stopc:
			return
		case <-t.C:
		}
		n := us.d.gw.Node()
		master := n != nil && n.Leader() == n.ID() && !n.Fenced()
		switch {
		case master && !running:
			if !us.caughtUp(n) {
				continue // next tick
			}
			running = true
			us.mu.Lock()
			pos := make(map[string]uint64, len(us.pos))
			for k, v := range us.pos {
				pos[k] = v
			}
			us.mu.Unlock()
			applied := us.d.db.Applied()
			for i, u := range us.list {
				u.Start(pos[u.Name()], us.notifiedUpTo(i, applied))
			}
			us.log.Info("uplinks started: this member is the master", "uplinks", len(us.list))
		case !master && running:
			running = false
			for _, u := range us.list {
				u.Stop()
			}
			us.log.Info("uplinks stopped: this member is no longer the master")
		}
	}
}

// caughtUp reports whether a new master has applied what the cluster
// committed before it: the position records among it, which the uplinks
// must start from.
func (us *uplinks) caughtUp(n *replication.Node) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	s, err := n.Status(ctx)
	return err == nil && s.Applied >= s.Commit
}

// notify hands a committed record to every uplink (the applier calls it
// for each, in log order). An uplink is not told of a sync record it
// forwards, nor of anything after it, until the record is settled
// (settled): it never sends what may yet be aborted, and keeps log order.
func (us *uplinks) notify(index uint64, topic []byte, size int, sync bool) {
	if us == nil {
		return
	}
	t := string(topic)
	us.gateMu.Lock()
	defer us.gateMu.Unlock()
	if us.gates == nil {
		us.gates = make([][]upNote, len(us.list))
	}
	for i, u := range us.list {
		if len(us.gates[i]) > 0 || (sync && u.Forwards(t)) {
			us.gates[i] = append(us.gates[i], upNote{index, t, size, sync})
			continue
		}
		u.Notify(index, t, size)
	}
}

// forwards reports whether an uplink forwards records on topic.
func (us *uplinks) forwards(topic []byte) bool {
	if us == nil {
		return false
	}
	t := string(topic)
	for _, u := range us.list {
		if u.Forwards(t) {
			return true
		}
	}
	return false
}

// settled lets each uplink go on past the sync records a settlement just
// settled: a confirmed one is notified, an aborted one never is (to the
// uplink it is an index without a record; uplinkLog leaves it out).
func (us *uplinks) settled() {
	if us == nil {
		return
	}
	us.gateMu.Lock()
	defer us.gateMu.Unlock()
	for i, u := range us.list {
		if i >= len(us.gates) {
			break
		}
		g := us.gates[i]
		for len(g) > 0 {
			nt := g[0]
			if nt.sync && u.Forwards(nt.topic) {
				held, aborted := us.d.broker.SyncState(nt.index)
				if held {
					break
				}
				if aborted {
					g = g[1:]
					continue
				}
			}
			u.Notify(nt.index, nt.topic, nt.size)
			g = g[1:]
		}
		if len(g) == 0 {
			g = nil
		}
		us.gates[i] = g
	}
}

// notifiedUpTo is how far uplink i may read at start: not past the first
// notification held back from it.
func (us *uplinks) notifiedUpTo(i int, applied uint64) uint64 {
	us.gateMu.Lock()
	defer us.gateMu.Unlock()
	if i < len(us.gates) && len(us.gates[i]) > 0 {
		return min(applied, us.gates[i][0].index-1)
	}
	return applied
}

// refuses reports whether a publish to topic must get 0x97: an uplink
// with on_full: refuse that forwards it is full.
func (us *uplinks) refuses(topic string) bool {
	if us == nil {
		return false
	}
	for _, u := range us.list {
		if u.Refuses(topic) {
			return true
		}
	}
	return false
}

// applyPositions applies a committed positions record: the highest
// position per name is kept, in memory and in the data file.
func (us *uplinks) applyPositions(index uint64, payload []byte) {
	var ps map[string]uint64
	if err := json.Unmarshal(payload, &ps); err != nil {
		us.d.skips.note(index, "uplinks", err)
		return
	}
	us.mu.Lock()
	for name, p := range ps {
		if p > us.pos[name] {
			us.pos[name] = p
			us.d.db.Stage(bucketUplinks, name, binary.BigEndian.AppendUint64(nil, p))
		}
	}
	us.mu.Unlock()
	us.setHold()
}

// setHold keeps retention below the lowest replicated position of the
// uplinks that may not drop: records after it are the cloud's still.
func (us *uplinks) setHold() {
	hold := uint64(math.MaxUint64)
	us.mu.Lock()
	for _, c := range us.cfgs {
		if c.OnFull != uplink.OnFullDropOldest && len(c.Topics) > 0 {
			hold = min(hold, us.pos[c.Name])
		}
	}
	us.mu.Unlock()
	us.d.db.SetHoldFloor(hold)
}

// byName returns the uplink called name, nil for none.
func (us *uplinks) byName(name string) *uplink.Uplink {
	if us == nil {
		return nil
	}
	for _, u := range us.list {
		if u.Name() == name {
			return u
		}
	}
	return nil
}

// status returns every uplink's status, in config order.
func (us *uplinks) status() []uplink.Status {
	if us == nil {
		return []uplink.Status{}
	}
	out := make([]uplink.Status, 0, len(us.list))
	for _, u := range us.list {
		out = append(out, u.Status())
	}
	return out
}

// uplinkLog is the log as the uplinks read it.
type uplinkLog struct {
	db *storage.DB
	d  *Daemon // its broker knows which sync records were aborted
}

// scanChunk bounds the records read in one storage transaction: the
// uplink's callbacks publish to the cloud and wait for its window and rate
// cap, which must not hold a read transaction open meanwhile.
const scanChunk = 128

// Committed reads the records from..to in chunks, each decoded under one
// read transaction and handed to fn after it.
func (l uplinkLog) Committed(from, to uint64, fn func(r *uplink.Record) bool) error {
	if first, _ := l.db.FirstIndex(); from < first {
		from = first
	}
	for from <= to {
		var batch []*uplink.Record
		next := to + 1
		err := l.db.Scan(from, func(e raftpb.Entry) bool {
			if e.Index > to {
				return false
			}
			next = e.Index + 1
			if e.Type != raftpb.EntryNormal || len(e.Data) == 0 {
				return len(batch) < scanChunk
			}
			if storage.RecordSync(e.Data) || storage.RecordQoS2(e.Data) {
				if _, aborted := l.d.broker.SyncState(e.Index); aborted {
					return len(batch) < scanChunk // its publisher was refused, or a resend's second copy
				}
			}
			rec, err := storage.DecodeRecord(e.Data)
			if err != nil || rec.Kind != storage.KindMessage {
				// The applier counted what it could not read; the
				// gateway's own records never leave the cluster.
				return len(batch) < scanChunk
			}
			batch = append(batch, uplinkRecord(e.Index, &rec, len(e.Data)))
			return len(batch) < scanChunk
		})
		if err != nil {
			return err
		}
		for _, r := range batch {
			if !fn(r) {
				return nil
			}
		}
		if next <= from {
			return nil // nothing more in the log
		}
		from = next
	}
	return nil
}

// FirstIndex is the oldest index the log holds.
func (l uplinkLog) FirstIndex() uint64 {
	first, _ := l.db.FirstIndex()
	return first
}

func uplinkRecord(index uint64, r *storage.Record, size int) *uplink.Record {
	u := &uplink.Record{
		Index: index, Origin: r.Origin, Seq: r.Seq, ClientID: r.ClientID, Topic: r.Topic,
		QoS: r.QoS, Retain: r.Retain, Time: r.Time, Payload: r.Payload, Size: size,
		Props: uplink.Properties{
			PayloadFormat: r.Props.PayloadFormat, PayloadFormatSet: r.Props.PayloadFormatSet,
			MessageExpiry: r.Props.MessageExpiry, MessageExpirySet: r.Props.MessageExpirySet,
			ContentType: r.Props.ContentType, ResponseTopic: r.Props.ResponseTopic, CorrelationData: r.Props.CorrelationData,
		},
	}
	for _, p := range r.Props.User {
		u.Props.User = append(u.Props.User, uplink.UserProperty{Key: p.Key, Value: p.Value})
	}
	return u
}

// positionSink replicates positions: one async control record per save.
type positionSink struct {
	d  *Daemon
	us *uplinks
}

// quietSpan is how far a position may move over records the uplink had
// nothing to do with before it is replicated anyway (retention waits for
// it). Below it such a move is not worth a record: a fresh gateway's log
// stays empty, so it can join a cluster without --requeue or --discard.
const quietSpan = 1024

// Save proposes the position; nobody waits. A record that is lost (no
// master) only means a few more duplicates after a failover.
func (s positionSink) Save(name string, index uint64) {
	if u := s.us.byName(name); u != nil {
		c := u.Counters()
		done := c.Forwarded + c.Dropped + c.Lost
		s.us.mu.Lock()
		quiet := done == s.us.done[name] && index < s.us.proposed[name]+quietSpan
		if !quiet {
			s.us.done[name], s.us.proposed[name] = done, index
		}
		s.us.mu.Unlock()
		if quiet {
			return
		}
	}
	b, _ := json.Marshal(map[string]uint64{name: index}) // cannot fail
	n := s.d.gw.Node()
	rec := controlRecord(n, storage.KindUplinks, "", b)
	n.Propose(storage.AppendRecord(nil, &rec), replication.Async, func(_ uint64, err error) {
		if err != nil && !errors.Is(err, replication.ErrStopped) {
			s.d.log.Debug("uplink position not logged", "uplink", name, "index", index, "error", err)
		}
	})
}

// localPublisher publishes an uplink's downlink messages into the local
// log, with the ack mode of their topic.
type localPublisher struct {
	d    *Daemon
	name string
}

// Publish returns once m meets its topic's ack rule, or fails.
func (p localPublisher) Publish(ctx context.Context, m *uplink.Message) error {
	msg := &mqtt.Message{
		ClientID: "uplink:" + p.name, Topic: m.Topic, QoS: m.QoS, Retain: m.Retain, Payload: m.Payload, Time: clock.Now().UnixNano(),
		PayloadFormat: m.Props.PayloadFormat, PayloadFormatSet: m.Props.PayloadFormatSet,
		MessageExpiry: m.Props.MessageExpiry, MessageExpirySet: m.Props.MessageExpirySet,
		ContentType: m.Props.ContentType, ResponseTopic: m.Props.ResponseTopic, CorrelationData: m.Props.CorrelationData,
	}
	for _, u := range m.Props.User {
		msg.User = append(msg.User, packets.UserProperty{Key: u.Key, Val: u.Value})
	}
	mode := mqtt.Async
	var policies []mqtt.TopicPolicy
	for _, t := range p.d.liveConfig().Topics {
		if am, err := mqtt.ParseAckMode(t.Ack); err == nil {
			policies = append(policies, mqtt.TopicPolicy{Filter: t.Match, Ack: am})
		}
	}
	mode = mqtt.AckFor(policies, m.Topic)
	la := &logAdapter{d: p.d}
	la.Reserve(msg)
	done := make(chan error, 1)
	la.Propose(msg, mode, mqtt.DoneFunc(func(err error) { done <- err }))
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// applyRecord applies a committed positions record (its encoded bytes);
// one it cannot read is counted and skipped.
func (us *uplinks) applyRecord(index uint64, data []byte) {
	rec, err := storage.DecodeRecord(data)
	if err != nil {
		us.d.skips.note(index, "uplinks", err)
		return
	}
	if rec.ClientID == pauseClient {
		us.applyPause(index, rec.Payload)
		return
	}
	us.applyPositions(index, rec.Payload)
}

// applyPause applies a committed pause record on this member: its uplink
// is paused or resumed (running or not), and the data file keeps it.
func (us *uplinks) applyPause(index uint64, payload []byte) {
	var op pauseOp
	if err := json.Unmarshal(payload, &op); err != nil {
		us.d.skips.note(index, "uplinks", err)
		return
	}
	u := us.byName(op.Name)
	if u == nil {
		return // an uplink of another member's config
	}
	if op.Paused {
		u.Pause()
		us.d.db.Stage(bucketPaused, op.Name, []byte{1})
	} else {
		u.Resume()
		us.d.db.StageDelete(bucketPaused, op.Name)
	}
	us.log.Info("uplink "+map[bool]string{true: "paused", false: "resumed"}[op.Paused], "uplink", op.Name, "index", index)
}

// uplinkAPI is the daemon as admin.Uplinks.
type uplinkAPI struct{ d *Daemon }

// SetPaused pauses or resumes an uplink on every member: it logs a pause
// record and returns once that is committed (a slave forwards it to the
// master) and applied here.
func (a uplinkAPI) SetPaused(name string, paused bool) (admin.UplinkResponse, error) {
	u := a.d.ups.byName(name)
	if u == nil {
		return admin.UplinkResponse{}, config.UsageError{Err: fmt.Errorf("no uplink named %q in this gateway's config", name)}
	}
	b, _ := json.Marshal(pauseOp{Name: name, Paused: paused}) // cannot fail
	n := a.d.gw.Node()
	rec := controlRecord(n, storage.KindUplinks, pauseClient, b)
	type result struct {
		index uint64
		err   error
	}
	done := make(chan result, 1)
	n.Propose(storage.AppendRecord(nil, &rec), replication.Async, func(i uint64, err error) { done <- result{i, err} })
	var r result
	select {
	case r = <-done:
	case <-time.After(a.d.cfg.Cluster.SyncTimeout.Duration() + time.Second):
		r.err = errors.New("not committed in time")
	}
	if r.err != nil {
		return admin.UplinkResponse{}, fmt.Errorf("%w: the pause could not be logged (%v)", admin.ErrNoMaster, r.err)
	}
	// Committed; this member applies it a moment later.
	for deadline := time.Now().Add(5 * time.Second); a.d.db.Applied() < r.index && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	return admin.UplinkResponse{Name: name, Paused: u.Status().Paused}, nil
}

// Uplinks is every uplink's status and totals (admin.UplinkSource).
func (us *uplinks) Uplinks() []admin.UplinkMetrics {
	out := make([]admin.UplinkMetrics, 0, len(us.list))
	for _, u := range us.list {
		out = append(out, admin.UplinkMetrics{Status: u.Status(), Counters: u.Counters()})
	}
	return out
}

// rewind follows a replaced log (a join, a deposed master's rejoin): a
// position past the new log's applied index named records of the old
// one, which the new log may hold otherwise; it falls back to applied,
// and the position records of the new log raise it again as they apply.
// Sending again beats skipping.
func (us *uplinks) rewind(applied uint64) {
	if us == nil {
		return
	}
	us.mu.Lock()
	for name, p := range us.pos {
		if p > applied {
			us.pos[name] = applied
			us.d.db.Stage(bucketUplinks, name, binary.BigEndian.AppendUint64(nil, applied))
		}
	}
	us.mu.Unlock()
	us.setHold()
}
