package storage

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"
	"golang.org/x/sys/unix"
)

// BenchmarkOpenCold is a gateway's start after a reboot: Open of a data
// file of 64 Ki records of 1 KB (91 MB) none of which is in the page cache
// (evicted before each Open, no root needed). Open reads the whole file to
// check it, and how it faults the pages in sets the number of reads the
// device serves, which on flash matters more than their size. majflt/op
// counts the faults that waited for the device: compare it, and ns/op,
// across builds in one run.
func BenchmarkOpenCold(b *testing.B) {
	dir := b.TempDir()
	db, err := Open(dir, nil)
	if err != nil {
		b.Fatal(err)
	}
	index := uint64(1)
	for index < 64<<10 {
		ents := makeEntries(index, 256, 1)
		for j := range ents {
			ents[j].Data = make([]byte, 1000)
		}
		if err := db.Save(pb.HardState{Term: 1, Vote: 1, Commit: index + 255}, ents); err != nil {
			b.Fatal(err)
		}
		index += 256
	}
	if err := db.Close(); err != nil {
		b.Fatal(err)
	}
	path := filepath.Join(dir, FileName)
	fi, err := os.Stat(path)
	if err != nil {
		b.Fatal(err)
	}
	evict := func() {
		f, err := os.Open(path)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			b.Fatal(err)
		}
	}
	majflt := func() int64 {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			b.Fatal(err)
		}
		return int64(ru.Majflt)
	}
	b.SetBytes(fi.Size())
	var faults int64
	for b.Loop() {
		b.StopTimer()
		evict()
		f0 := majflt()
		b.StartTimer()
		db, err := Open(dir, nil)
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		faults += majflt() - f0
		if err := db.Close(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(faults)/float64(b.N), "majflt/op")
}
