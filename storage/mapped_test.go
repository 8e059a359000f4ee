package storage

import (
	"bufio"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"
)

// mappedKiB is how much of the file at path the process has mapped
// (the Rss lines of its mappings in /proc/self/smaps).
func mappedKiB(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skipf("no /proc/self/smaps here: %v", err)
	}
	defer f.Close()
	kib, in := 0, false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		switch {
		case len(fields) >= 5 && strings.Contains(fields[0], "-"):
			in = len(fields) >= 6 && fields[5] == path
		case in && len(fields) == 3 && fields[0] == "Rss:":
			n, _ := strconv.Atoi(fields[1])
			kib += n
		}
	}
	return kib
}

// The pages of the file the process has read through bbolt's mapping (a
// scan of the whole log here; the moving right edge of the log at every
// commit) do not stay in its RSS: a release period later they are gone.
func TestMappedPagesStayFew(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("smaps and MADV_DONTNEED: Linux only")
	}
	db := testOpen(t, t.TempDir(), nil)
	index := uint64(1)
	commit := func(n, per, size int) {
		for i := 0; i < n; i++ {
			ents := makeEntries(index, uint64(per), 1)
			for j := range ents {
				ents[j].Data = make([]byte, size)
			}
			mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, ents)
			index += uint64(per)
		}
	}
	commit(2*releaseEvery, 50, 400)
	if err := db.Scan(1, func(pb.Entry) bool { return true }); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(db.Path())
	if err != nil {
		t.Fatal(err)
	}
	scanned := mappedKiB(t, db.Path())
	// Small commits: a growing file makes bbolt map it anew, which would
	// drop the old mapping's pages by itself.
	commit(releaseEvery, 1, 10)
	mapped := mappedKiB(t, db.Path())
	t.Logf("%d KiB of the %d KiB file mapped after a full scan, %d KiB %d commits later", scanned, fi.Size()>>10, mapped, releaseEvery)
	// At most one release period's pages (about four per commit), with room.
	if limit := 2 * releaseEvery * 4 * 4; mapped > limit {
		t.Errorf("%d KiB of the file still mapped %d commits after a full scan (%d KiB then), want at most %d", mapped, releaseEvery, scanned, limit)
	}
}

// Open reads every page of the file (the checks of the log, bbolt's
// rebuild of its freelist): a gateway started on a large data file must
// not carry those pages in its RSS afterwards (124 MB on a 111 MB file).
func TestOpenLeavesFewPagesMapped(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("smaps and MADV_DONTNEED: Linux only")
	}
	dir := t.TempDir()
	db, err := Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	index := uint64(1)
	for i := 0; i < 200; i++ {
		ents := makeEntries(index, 40, 1)
		for j := range ents {
			ents[j].Data = make([]byte, 1000)
		}
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, ents)
		index += 40
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	db = testOpen(t, dir, nil)
	fi, err := os.Stat(db.Path())
	if err != nil {
		t.Fatal(err)
	}
	mapped := mappedKiB(t, db.Path())
	t.Logf("%d KiB of the %d KiB file mapped after Open", mapped, fi.Size()>>10)
	if fi.Size() < 4<<20 {
		t.Fatalf("the file is %d KiB, too small to tell", fi.Size()>>10)
	}
	if limit := 1024; mapped > limit {
		t.Errorf("%d KiB of the %d KiB file mapped after Open, want at most %d", mapped, fi.Size()>>10, limit)
	}
}
