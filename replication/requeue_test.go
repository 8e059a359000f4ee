package replication

import (
	"errors"
	"runtime"
	"testing"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// A deposed master's requeue bucket can hold a log budget's worth of
// records (here 32 MB). Answering the publishers still waiting for records
// in it must not read the bucket into memory: every one of them hears
// errDeposedTail, the others keep waiting, and the answer allocates a
// small fraction of what the bucket holds.
func TestRefuseRequeuedAnswersEveryWaitingPublisherInBoundedMemory(t *testing.T) {
	const records, size, origin = 16000, 2000, 7
	db, err := storage.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	payload := make([]byte, size)
	var ents []pb.Entry
	for i := range records {
		r := storage.Record{Origin: origin, Seq: uint64(i + 1), ClientID: "c", Topic: "s/t", QoS: 1, Sync: true, Time: time.Now().UnixNano(), Payload: payload}
		ents = append(ents, pb.Entry{Index: uint64(i + 1), Term: 1, Data: storage.AppendRecord(nil, &r)})
		if len(ents) == 1000 {
			if err := db.Save(pb.HardState{Term: 1, Vote: 1}, ents); err != nil {
				t.Fatal(err)
			}
			ents = ents[:0]
		}
	}
	// The new master's log holds none of it: all of it is requeued.
	if err := db.ResetRaftFrom(1); err != nil {
		t.Fatal(err)
	}
	if n, err := db.RequeuePending(); err != nil || n != records {
		t.Fatalf("requeued %d, %v; want %d", n, err, records)
	}

	n := &Node{db: db, log: discard(), live: map[recID]*proposal{}}
	answered := map[uint64]error{}
	wait := func(seq uint64) {
		n.live[recID{origin, seq}] = &proposal{id: recID{origin, seq}, mode: Sync, stepped: true,
			to: outcomeFunc(func(_ uint64, err error) { answered[seq] = err })}
	}
	var waiting []uint64
	for seq := uint64(1); seq <= records; seq += 97 { // spread over every chunk
		wait(seq)
		waiting = append(waiting, seq)
	}
	wait(records + 1) // not in the bucket: still in flight elsewhere

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	n.refuseRequeued()
	runtime.ReadMemStats(&after)

	for _, seq := range waiting {
		if err, ok := answered[seq]; !ok || !errors.Is(err, errDeposedTail) {
			t.Fatalf("publisher of requeued record %d heard %v (answered %v); want errDeposedTail", seq, err, ok)
		}
	}
	if _, ok := answered[records+1]; ok || n.live[recID{origin, records + 1}] == nil {
		t.Error("the publisher of a record outside the bucket was answered")
	}
	if len(answered) != len(waiting) {
		t.Errorf("%d publishers answered; want %d", len(answered), len(waiting))
	}
	held := after.TotalAlloc - before.TotalAlloc
	t.Logf("a %d MB requeue bucket answered %d publishers with %d KB allocated", records*size>>20, len(waiting), held>>10)
	if limit := uint64(records * size / 32); held > limit {
		t.Errorf("answering the waiting publishers allocated %d bytes, more than %d (1/32 of the bucket)", held, limit)
	}
}
