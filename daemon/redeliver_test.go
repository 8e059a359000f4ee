package daemon

import (
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// A deposed master's tail comes back re-published through the new master:
// its subscribers got those records once already and must not again, while
// records they never had (the new master's own) are delivered. Each id is
// skipped once, and the set survives a restart.
func TestRedeliveryOfTheDeposedTailIsSkippedOnce(t *testing.T) {
	dir := t.TempDir()
	d := testGateway(t, dir, nil)
	sub, got := v5(t, d.MQTTAddr(), "sub", nil)
	subscribe(t, sub, "a/#", 1)
	pub, _ := v5(t, d.MQTTAddr(), "pub", nil)
	for _, tp := range []string{"a/1", "a/2", "a/3"} {
		publish(t, pub, &paho.Publish{Topic: tp, QoS: 1, Payload: []byte(tp)})
	}
	for range 3 {
		receive(t, got, 5*time.Second)
	}
	// The rejoin remembers what it had delivered (here: the whole log).
	var tail []raftpb.Entry
	if err := d.db.Scan(1, func(e raftpb.Entry) bool {
		if e.Type == raftpb.EntryNormal && len(e.Data) > 0 {
			tail = append(tail, e)
		}
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if err := d.redeliver.remember(d.db, tail[0].Index, tail[len(tail)-1].Index); err != nil {
		t.Fatal(err)
	}
	if n := d.redeliver.pending(); n != 3 {
		t.Fatalf("%d ids remembered, want 3", n)
	}
	// They come back re-published, at new indexes, and a new record
	// after them.
	apply := d.redeliver.wrap(d.apply)
	next := tail[len(tail)-1].Index + 100
	for i, e := range tail[:2] {
		rec, err := storage.DecodeRecord(e.Data)
		if err != nil {
			t.Fatal(err)
		}
		rec.Republished = true
		if err := apply.Apply(next+uint64(i), storage.AppendRecord(nil, &rec)); err != nil {
			t.Fatal(err)
		}
	}
	fresh := storage.Record{Origin: 7, Seq: 1, ClientID: "other", Topic: "a/new", QoS: 1, Time: time.Now().UnixNano(), Payload: []byte("new")}
	if err := apply.Apply(next+10, storage.AppendRecord(nil, &fresh)); err != nil {
		t.Fatal(err)
	}
	if m := receive(t, got, 5*time.Second); m.Topic != "a/new" {
		t.Fatalf("delivered %s again; want only a/new", m.Topic)
	}
	if n := d.redeliver.pending(); n != 1 {
		t.Fatalf("%d ids left, want 1 (a/3 has not come back yet)", n)
	}

	// Across a restart the ids not yet used are still known (those used
	// may be too: the set is saved in batches, and a stale id only costs
	// memory).
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	d = testGateway(t, dir, nil)
	sub, got = v5(t, d.MQTTAddr(), "sub2", nil)
	subscribe(t, sub, "a/#", 1)
	rec, err := storage.DecodeRecord(tail[2].Data)
	if err != nil {
		t.Fatal(err)
	}
	rec.Republished = true
	apply = d.redeliver.wrap(d.apply)
	if err := apply.Apply(next+20, storage.AppendRecord(nil, &rec)); err != nil {
		t.Fatal(err)
	}
	fresh.Seq = 2
	fresh.Topic = "a/new2"
	if err := apply.Apply(next+21, storage.AppendRecord(nil, &fresh)); err != nil {
		t.Fatal(err)
	}
	if m := receive(t, got, 5*time.Second); m.Topic != "a/new2" {
		t.Fatalf("after a restart: delivered %s; want only a/new2", m.Topic)
	}
}
