package daemon

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/mochi-mqtt/server/v2/packets"
	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// logAdapter plugs replication into the broker: it is the broker's Log.
type logAdapter struct{ d *Daemon }

// Reserve gives m this node's id and a fresh sequence number.
func (a *logAdapter) Reserve(m *mqtt.Message) {
	m.Origin = a.d.gw.Node().ID()
	m.Seq = a.d.gw.Node().NextSeq()
}

// Logged scans the log for the records of origin with the given sequence
// numbers. It runs at start, for the few QoS 2 flows a crash interrupted.
func (a *logAdapter) Logged(origin uint64, seqs []uint64) (map[uint64]bool, error) {
	want := make(map[uint64]bool, len(seqs))
	for _, s := range seqs {
		want[s] = true
	}
	found := map[uint64]bool{}
	err := a.d.db.Scan(1, func(e raftpb.Entry) bool {
		if e.Type == raftpb.EntryNormal && len(e.Data) > 0 {
			if o, s, err := storage.RecordID(e.Data); err == nil && o == origin && want[s] {
				found[s] = true
			}
		}
		return len(found) < len(want)
	})
	return found, err
}

// Propose encodes m as a record and proposes it. The encoded bytes belong
// to raft from here on (its unstable log and our tail cache keep them), so
// they are allocated per record, once, at their exact size.
func (a *logAdapter) Propose(m *mqtt.Message, mode mqtt.AckMode, done mqtt.Done) {
	if a.d.ups.refuses(m.Topic) {
		done.Done(fmt.Errorf("%w: an uplink's backlog is full (on_full: refuse)", mqtt.ErrQuota))
		return
	}
	rmode := replication.Async
	if mode == mqtt.Sync || (mode == mqtt.Replicated && a.d.otherMemberReachable()) {
		rmode = replication.Sync
	}
	rec := recordOf(m)
	// A publish under a sync rule is held on every member until the
	// master settles it; the cluster's own records are applied as they
	// come (their senders act on their outcome themselves).
	rec.Sync = rmode == replication.Sync && rec.Kind == storage.KindMessage
	rec.Legacy = rec.Kind != storage.KindMessage && a.d.gw.Node().LegacyControl()
	data := storage.AppendRecord(make([]byte, 0, 64+len(m.Topic)+len(m.ClientID)+len(m.Payload)), &rec)
	// The adapter itself takes the outcome, done its tag: no callback
	// allocated per publish.
	a.d.gw.Node().ProposeTo(data, rmode, a, done)
}

// Resolved implements replication.Outcomes for Propose: tag is the
// publish's mqtt.Done, which runs on the ack queue's goroutine, not raft's.
func (a *logAdapter) Resolved(tag any, _ uint64, err error) {
	if errors.Is(err, replication.ErrStorage) {
		// One line: the text becomes the PUBACK's reason string,
		// where a control character (errors.Join's newline) makes
		// strict clients (mosquitto) drop the packet as malformed.
		err = fmt.Errorf("%w: %w", mqtt.ErrQuota, err)
	}
	a.d.acks.push(tag.(mqtt.Done), err)
}

// The broker's record kinds as the log's.
var (
	storageKinds = [...]storage.Kind{mqtt.KindMessage: storage.KindMessage, mqtt.KindSession: storage.KindSession, mqtt.KindCursors: storage.KindCursors}
	mqttKinds    = map[storage.Kind]mqtt.Kind{storage.KindMessage: mqtt.KindMessage, storage.KindSession: mqtt.KindSession, storage.KindCursors: mqtt.KindCursors}
)

func recordOf(m *mqtt.Message) storage.Record {
	r := storage.Record{
		Kind:   storageKinds[m.Kind],
		Origin: m.Origin, Seq: m.Seq, ClientID: m.ClientID, Topic: m.Topic, QoS: m.QoS,
		Retain: m.Retain, Will: m.Will, PacketID: m.PacketID, Time: m.Time, Payload: m.Payload,
		Props: storage.Properties{
			PayloadFormat: m.PayloadFormat, PayloadFormatSet: m.PayloadFormatSet,
			MessageExpiry: m.MessageExpiry, MessageExpirySet: m.MessageExpirySet,
			ContentType: m.ContentType, ResponseTopic: m.ResponseTopic, CorrelationData: m.CorrelationData,
		},
	}
	for _, u := range m.User {
		r.Props.User = append(r.Props.User, storage.UserProperty{Key: u.Key, Value: u.Val})
	}
	return r
}

func messageOf(r *storage.Record) *mqtt.Message {
	m := &mqtt.Message{
		Kind:   mqttKinds[r.Kind],
		Origin: r.Origin, Seq: r.Seq, ClientID: r.ClientID, Topic: r.Topic, QoS: r.QoS,
		Retain: r.Retain, Will: r.Will, Sync: r.Sync, Republished: r.Republished, PacketID: r.PacketID, Time: r.Time, Payload: r.Payload,
		PayloadFormat: r.Props.PayloadFormat, PayloadFormatSet: r.Props.PayloadFormatSet,
		MessageExpiry: r.Props.MessageExpiry, MessageExpirySet: r.Props.MessageExpirySet,
		ContentType: r.Props.ContentType, ResponseTopic: r.Props.ResponseTopic, CorrelationData: r.Props.CorrelationData,
	}
	for _, u := range r.Props.User {
		m.User = append(m.User, mqttUser(u))
	}
	return m
}

// applier delivers committed records to the broker. It waits for the
// broker to have loaded its persisted state first: applying on top of a
// retained store that is then overwritten by the older one on disk would
// lose the newer retained messages.
type applier struct {
	ready  chan struct{}
	broker *mqtt.Server
	ups    *uplinks // nil without uplinks
	skips  *skips
	// quietUntil: records up to this index are a joined cluster's
	// history; they only update the retained store.
	quietUntil atomic.Uint64
}

// Apply decodes a record in full only when it is retained or has a local
// subscriber: on a gateway most records have neither. It never fails: a
// record it cannot read or apply is counted and skipped, as every member
// skips it at the same index, and the member goes on serving (DESIGN.md,
// "The record").
func (a *applier) Apply(index uint64, data []byte) error {
	<-a.ready
	kind, topic, retain, err := storage.RecordHead(data)
	if err != nil {
		a.skip(index, "unreadable", err)
		return nil
	}
	held := storage.RecordSync(data) // held until the master settles it
	if kind != storage.KindMessage {
		// Uplinks count and forward device messages only; a control
		// record moves them past its index under a $ topic, which no
		// rule forwards, whatever topic (or none) the record carries.
		topic = []byte("$tandem/" + kind.String())
	}
	// A QoS 2 publish may be the second copy of one its device resent
	// (mqtt: inboundDup): the broker decides that as it applies it,
	// whoever subscribes, and the uplinks read it only after.
	qos2 := kind == storage.KindMessage && storage.RecordQoS2(data)
	if qos2 {
		defer a.ups.notify(index, topic, len(data), held)
	} else {
		a.ups.notify(index, topic, len(data), held)
	}
	switch kind {
	case storage.KindMessage, storage.KindSession, storage.KindCursors:
	case storage.KindUplinks:
		if a.ups != nil {
			a.ups.applyRecord(index, data)
		}
		a.broker.Applied(index)
		return nil
	case storage.KindSettle:
		a.settle(index, data)
		return nil
	case storage.KindFeature:
		// Replication applies a readable one and never hands it on.
		a.skip(index, "feature", errors.New("a feature level record without its one-byte level"))
		return nil
	default:
		a.skip(index, kind.String(), errors.New("a control record of a kind this build does not know"))
		return nil
	}
	quiet := index <= a.quietUntil.Load()
	// The cluster's own records (persistent sessions) are applied in the
	// quiet history too: a joiner learns the sessions.
	control := kind != storage.KindMessage
	// A sync record nobody subscribes to needs no hold (a subscription
	// made later starts after it), unless an uplink forwards it: uplinks
	// ask the broker whether it is settled.
	if !retain && !control && !qos2 && (!held || !a.ups.forwards(topic)) && (quiet || a.broker.Unrouted(topic)) {
		a.broker.Applied(index)
		return nil // nobody subscribes: no Message to build
	}
	rec, err := storage.DecodeRecord(data)
	if err != nil {
		a.skip(index, "unreadable", err)
		return nil
	}
	if quiet {
		a.broker.Retain(index, messageOf(&rec))
		a.broker.Applied(index)
		return nil
	}
	return a.broker.Deliver(index, messageOf(&rec))
}

// Restore takes in a snapshot that replaces the log (replication.Restorer):
// the broker swaps its sessions and retained messages for the snapshot's
// around install, then the uplinks reload their positions.
func (a *applier) Restore(index uint64, install func() error) error {
	<-a.ready
	if err := a.broker.Restore(index, install); err != nil {
		return err
	}
	return a.ups.restore()
}

// skip counts and logs a record the applier skips.
func (a *applier) skip(index uint64, kind string, err error) {
	a.broker.Applied(index)
	a.skips.note(index, kind, err)
}

// settle applies the master's settlement record, in the quiet history too:
// what a joiner holds is settled the same way. One it cannot read is
// skipped like any other record: only a master writes settlements (no
// device can: the kind is in the header), and the next settlement's
// Upto covers what this one would have confirmed; what it would have
// aborted, and no later one names, is confirmed by it. A member stopped
// by its own log would serve nobody.
func (a *applier) settle(index uint64, data []byte) {
	rec, err := storage.DecodeRecord(data)
	if err != nil {
		a.skip(index, "settle", err)
		return
	}
	s, err := replication.DecodeSettlement(rec.Payload)
	if err != nil {
		a.skip(index, "settle", err)
		return
	}
	a.broker.Settle(index, s.Upto, s.Abort, s.Doubt, s.Alone)
	a.ups.settled()
}

// Holding implements replication.Holder: a new master settles the sync
// records the broker holds.
func (a *applier) Holding() bool { return a.broker.Holding() }

// Aborted implements replication.Aborter: a forward that comes again for
// a sync record an earlier master aborted is refused, not acked.
func (a *applier) Aborted(index uint64) bool { return a.broker.Aborted(index) }

// snapshotBuckets registers what a snapshot of this gateway's data file
// carries besides the members: the broker's sessions, converted
// (mqtt.SnapshotSessions), and the uplinks' positions and pauses.
func snapshotBuckets(db *storage.DB) {
	db.SnapshotBucket(storage.BucketSessions, mqtt.SnapshotSessions)
	db.SnapshotBucket(bucketUplinks, nil)
	db.SnapshotBucket(bucketPaused, nil)
}

// FirstIndex is the oldest index the log still holds (mqtt.Retained),
// the records pulled from before an installed snapshot included.
func (a *logAdapter) FirstIndex() uint64 { return a.d.db.OldestIndex() }

// Committed reads the records from..to for sessions that replay from
// their cursor. The broker asks only up to what the applier has handed it,
// so all of it is committed; it is not bounded by the storage's applied
// index, which is recorded after a whole batch is applied and would make a
// replay skip the batch's records.
func (a *logAdapter) Committed(from, to uint64, fn func(index uint64, m *mqtt.Message) bool) error {
	// Retention dropped the records below the first index: a replay
	// starts at the oldest one kept (the broker counts what its session
	// lost by the gap).
	if first := a.d.db.OldestIndex(); from < first {
		from = first
	}
	if from > to {
		return nil
	}
	err := a.d.db.Scan(from, func(e raftpb.Entry) bool {
		if e.Index > to {
			return false
		}
		if e.Type != raftpb.EntryNormal || len(e.Data) == 0 {
			return true
		}
		rec, err := storage.DecodeRecord(e.Data)
		if err != nil || rec.Kind != storage.KindMessage {
			return true // the applier counted what it could not read
		}
		return fn(e.Index, messageOf(&rec))
	})
	return err
}

// sessionStore keeps the broker's sessions in the data file, staged so they
// commit with the log.
type sessionStore struct{ db *storage.DB }

func (s sessionStore) Put(k string, v []byte) { s.db.Stage(storage.BucketSessions, k, v) }
func (s sessionStore) Delete(k string)        { s.db.StageDelete(storage.BucketSessions, k) }
func (s sessionStore) Sync() error            { return s.db.Sync() }
func (s sessionStore) Load(prefix string, fn func(string, []byte) error) error {
	return s.db.ForEach(storage.BucketSessions, prefix, func(k, v []byte) error { return fn(string(k), v) })
}

func mqttUser(u storage.UserProperty) packets.UserProperty {
	return packets.UserProperty{Key: u.Key, Val: u.Value}
}

// otherMemberReachable reports whether this node has a link to another
// member of its cluster: a Replicated record then waits for one to hold it.
func (d *Daemon) otherMemberReachable() bool {
	n := d.gw.Node()
	for _, m := range n.Members() {
		if m.ID != n.ID() && d.gw.Reachable(m.ID) {
			return true
		}
	}
	return false
}

// LegacyControl implements mqtt.ControlEncoding: below feature level 2 a
// member may run v0.1.0, which reads cursor records as JSON only.
func (a *logAdapter) LegacyControl() bool { return a.d.gw.Node().LegacyControl() }

// PageCounts implements mqtt.CapRules: from feature level 3 the caps on
// retained messages and sessions count pages; below it bytes, as the
// builds before it do.
func (a *logAdapter) PageCounts() bool { return a.d.gw.Node().PageCounts() }

// InboundResends implements mqtt.ResendRules: from feature level 4 every
// member delivers a QoS 2 resend and its late original once.
func (a *logAdapter) InboundResends() bool { return a.d.gw.Node().InboundResends() }

// CapsApplied implements mqtt.CapRules: below feature level 2 a member may
// run v0.1.0, which retains every retained record, capped or not.
func (a *logAdapter) CapsApplied() bool { return !a.d.gw.Node().LegacyControl() }

// OtherMembers implements mqtt.Clustered: whether the cluster has members
// besides this gateway.
func (a *logAdapter) OtherMembers() bool { return len(a.d.gw.Node().Members()) > 1 }
