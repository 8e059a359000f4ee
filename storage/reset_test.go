package storage

import (
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"
)

func TestResetRaftForJoining(t *testing.T) { forFormats(t, testResetRaftForJoining) }

func testResetRaftForJoining(t *testing.T, seg bool) {
	for _, requeue := range []bool{false, true} {
		dir := t.TempDir()
		db, err := Open(dir, &Options{segmented: seg})
		if err != nil {
			t.Fatal(err)
		}
		rec := Record{Origin: 1, Seq: 1, Topic: "t", QoS: 1, Payload: []byte("x")}
		ents := []pb.Entry{
			{Index: 1, Term: 1, Type: pb.EntryConfChange},
			{Index: 2, Term: 2, Data: AppendRecord(nil, &rec)},
			{Index: 3, Term: 2},
		}
		if err := db.Save(pb.HardState{Term: 2, Vote: 1, Commit: 3}, ents); err != nil {
			t.Fatal(err)
		}
		db.SetConfState(pb.ConfState{Voters: []uint64{1}})
		db.SetApplied(3)
		db.Stage(BucketMembers, "0000000000000001", []byte("{}"))
		if n, _ := db.DataRecords(); n != 1 {
			t.Fatalf("DataRecords = %d, want 1", n)
		}
		if err := db.ResetRaft(requeue); err != nil {
			t.Fatal(err)
		}
		db.Close()
		if db, err = Open(dir, nil); err != nil {
			t.Fatal(err)
		}
		hs, cs, _ := db.InitialState()
		last, _ := db.LastIndex()
		if hs != (pb.HardState{}) || len(cs.Voters) != 0 || last != 0 || db.Applied() != 0 {
			t.Fatalf("after reset: hs %+v cs %+v last %d applied %d", hs, cs, last, db.Applied())
		}
		var members int
		db.ForEach(BucketMembers, "", func(_, _ []byte) error { members++; return nil })
		rq, _ := db.Requeued(10)
		if members != 0 || (requeue && len(rq) != 1) || (!requeue && len(rq) != 0) {
			t.Fatalf("requeue=%v: %d members, %d requeued", requeue, members, len(rq))
		}
		if n, err := db.RequeuePending(); err != nil || n != len(rq) {
			t.Fatalf("RequeuePending = %d, %v; want %d", n, err, len(rq))
		}
		if requeue {
			if got, err := DecodeRecord(rq[0].Data); err != nil || got.Topic != "t" {
				t.Fatalf("requeued record %+v %v", got, err)
			}
		}
		db.Close()
	}
}
