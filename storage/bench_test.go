package storage

import (
	"bytes"
	"fmt"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"
)

// BenchmarkSave measures the group commit: one Save (one bbolt transaction,
// so its fsyncs) per batch of records with a 100-byte payload, encoded as
// the daemon encodes them. Every iteration hits the disk; run it with a
// fixed count, e.g. -benchtime 200x. records/s is the figure to compare
// with FACTS.md; ns/op is the time of one Save.
func BenchmarkSave(b *testing.B) {
	payload := bytes.Repeat([]byte{'p'}, 100)
	for _, batch := range []int{1, 10, 100, 1000} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			db, err := Open(b.TempDir(), nil)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { db.Close() })

			data := make([][]byte, batch)
			size := 0
			for i := range data {
				r := Record{
					Origin: 0x0102030405060708, Seq: uint64(i), ClientID: "bench-client",
					Topic: "plant/line-3/temperature", QoS: 1, PacketID: uint16(i),
					Time: 1_700_000_000_000_000_000 + int64(i), Payload: payload,
				}
				data[i] = AppendRecord(nil, &r)
				size += len(data[i])
			}
			ents := make([]pb.Entry, batch)
			next := uint64(1)
			saves := 0
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				for i := range ents {
					ents[i] = pb.Entry{Index: next, Term: 1, Type: pb.EntryNormal, Data: data[i]}
					next++
				}
				if err := db.Save(pb.HardState{Term: 1, Vote: 1, Commit: next - 1}, ents); err != nil {
					b.Fatal(err)
				}
				saves++
			}
			b.ReportMetric(float64(saves*batch)/b.Elapsed().Seconds(), "records/s")
		})
	}
}

// BenchmarkSaveRetention is BenchmarkSave at batch 100 with an 8 MiB
// budget reached: every checkpoint drops runs. Retention must not show on
// the ack path: compare records/s with budget=off in one run.
func BenchmarkSaveRetention(b *testing.B) {
	payload := bytes.Repeat([]byte{'p'}, 100)
	const batch = 100
	for _, budget := range []int64{0, 8 << 20} {
		name := "budget=off"
		if budget > 0 {
			name = "budget=8MiB"
		}
		b.Run(name, func(b *testing.B) {
			db, err := Open(b.TempDir(), &Options{MaxBytes: budget})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { db.Close() })
			db.SetRetentionFloor(^uint64(0))
			ents := make([]pb.Entry, batch)
			next := uint64(1)
			// Fill past the budget first, so the timed Saves drop.
			fill := func() {
				for i := range ents {
					r := Record{Origin: 1, Seq: next, ClientID: "bench-client", Topic: "plant/line-3/temperature", QoS: 1, Time: 1, Payload: payload}
					ents[i] = pb.Entry{Index: next, Term: 1, Type: pb.EntryNormal, Data: AppendRecord(nil, &r)}
					next++
				}
				if err := db.Save(pb.HardState{Term: 1, Vote: 1, Commit: next - 1}, ents); err != nil {
					b.Fatal(err)
				}
				db.SetApplied(next - 1)
			}
			for next < 100_000 {
				fill()
			}
			saves := 0
			b.ResetTimer()
			for b.Loop() {
				fill()
				saves++
			}
			b.ReportMetric(float64(saves*batch)/b.Elapsed().Seconds(), "records/s")
			if first, _ := db.FirstIndex(); budget > 0 && first == 1 {
				b.Fatal("nothing dropped")
			}
		})
	}
}
