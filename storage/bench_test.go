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
