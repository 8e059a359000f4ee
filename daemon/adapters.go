package daemon

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
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
func (a *logAdapter) Propose(m *mqtt.Message, mode mqtt.AckMode, done func(error)) {
	if a.d.ups.refuses(m.Topic) {
		done(fmt.Errorf("%w: an uplink's backlog is full (on_full: refuse)", mqtt.ErrQuota))
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
	rec.Sync = rmode == replication.Sync && !strings.HasPrefix(m.Topic, controlPrefix)
	data := storage.AppendRecord(make([]byte, 0, 64+len(m.Topic)+len(m.ClientID)+len(m.Payload)), &rec)
	a.d.gw.Node().Propose(data, rmode, func(_ uint64, err error) {
		if errors.Is(err, replication.ErrStorage) {
			// One line: the text becomes the PUBACK's reason string,
			// where a control character (errors.Join's newline) makes
			// strict clients (mosquitto) drop the packet as malformed.
			err = fmt.Errorf("%w: %w", mqtt.ErrQuota, err)
		}
		a.d.acks.push(done, err) // to the broker on the queue's goroutine, not raft's
	})
}

func recordOf(m *mqtt.Message) storage.Record {
	r := storage.Record{
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
		Origin: r.Origin, Seq: r.Seq, ClientID: r.ClientID, Topic: r.Topic, QoS: r.QoS,
		Retain: r.Retain, Will: r.Will, Sync: r.Sync, PacketID: r.PacketID, Time: r.Time, Payload: r.Payload,
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
	// quietUntil: records up to this index are a joined cluster's
	// history; they only update the retained store.
	quietUntil atomic.Uint64
}

// Apply decodes a record in full only when it is retained or has a local
// subscriber: on a gateway most records have neither.
func (a *applier) Apply(index uint64, data []byte) error {
	<-a.ready
	topic, retain, err := storage.RecordTopic(data)
	if err != nil {
		return err
	}
	held := storage.RecordSync(data) // held until the master settles it
	a.ups.notify(index, topic, len(data), held)
	if a.ups != nil && string(topic) == positionsTopic {
		if err := a.ups.applyRecord(index, data); err != nil {
			return err
		}
		a.broker.Applied(index)
		return nil
	}
	if string(topic) == replication.SettleTopic {
		return a.settle(index, data)
	}
	quiet := index <= a.quietUntil.Load()
	// The cluster's own records (persistent sessions) are applied in the
	// quiet history too: a joiner learns the sessions.
	control := bytes.HasPrefix(topic, []byte(controlPrefix))
	// A sync record nobody subscribes to needs no hold (a subscription
	// made later starts after it), unless an uplink forwards it: uplinks
	// ask the broker whether it is settled.
	if !retain && !control && (!held || !a.ups.forwards(topic)) && (quiet || a.broker.Unrouted(topic)) {
		a.broker.Applied(index)
		return nil // nobody subscribes: no Message to build
	}
	rec, err := storage.DecodeRecord(data)
	if err != nil {
		return err
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

// controlPrefix starts the topics of the cluster's own records.
const controlPrefix = "$tandem/"

// settle applies the master's settlement record, in the quiet history too:
// what a joiner holds is settled the same way.
func (a *applier) settle(index uint64, data []byte) error {
	rec, err := storage.DecodeRecord(data)
	if err != nil {
		return err
	}
	s, err := replication.DecodeSettlement(rec.Payload)
	if err != nil {
		// Skipping it could deliver what it aborts: a CRC-valid record
		// this build cannot read stops the apply, as a damaged one does.
		return fmt.Errorf("record %d: %w", index, err)
	}
	a.broker.Settle(index, s.Upto, s.Abort, s.Doubt, s.Alone)
	a.ups.settled()
	return nil
}

// Holding implements replication.Holder: a new master settles the sync
// records the broker holds.
func (a *applier) Holding() bool { return a.broker.Holding() }

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
	var derr error
	err := a.d.db.Scan(from, func(e raftpb.Entry) bool {
		if e.Index > to {
			return false
		}
		if e.Type != raftpb.EntryNormal || len(e.Data) == 0 {
			return true
		}
		rec, err := storage.DecodeRecord(e.Data)
		if err != nil {
			derr = fmt.Errorf("record %d: %w", e.Index, err)
			return false
		}
		return fn(e.Index, messageOf(&rec))
	})
	if err != nil {
		return err
	}
	return derr
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

// OtherMembers implements mqtt.Clustered: whether the cluster has members
// besides this gateway.
func (a *logAdapter) OtherMembers() bool { return len(a.d.gw.Node().Members()) > 1 }
