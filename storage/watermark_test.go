package storage

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeDisk is a filesystem whose free space a test sets.
type fakeDisk struct{ free, total atomic.Int64 }

func (d *fakeDisk) statfs(string) (int64, int64, error) { return d.free.Load(), d.total.Load(), nil }

// waitLow polls until db's watermark reads want.
func waitLow(t *testing.T, db *DB, want bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for db.LowOnSpace() != want {
		if time.Now().After(deadline) {
			t.Fatalf("LowOnSpace stayed %v (space %+v)", !want, db.SpaceStats())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Below storage.min_free the DB says so, with the reason devices and the
// status page get, and it says so no more once space returns, by itself;
// the log stays readable and writable throughout (what is refused is
// decided above it).
func TestMinFreeRefusesBelowTheWatermarkAndResumes(t *testing.T) {
	disk := &fakeDisk{}
	disk.total.Store(16 << 30)
	disk.free.Store(8 << 30)
	db := testOpen(t, t.TempDir(), &Options{MinFree: 512 << 20, FreeSpace: disk.statfs})
	waitLow(t, db, false)
	if why := db.RefusingReason(); why != "" {
		t.Fatalf("RefusingReason with 8 GiB free = %q", why)
	}
	disk.free.Store(100 << 20)
	waitLow(t, db, true)
	why := db.RefusingReason()
	if !strings.Contains(why, "100 MiB free") || !strings.Contains(why, "storage.min_free (512 MiB)") {
		t.Fatalf("RefusingReason = %q; want the free space and the watermark", why)
	}
	if s := db.SpaceStats(); s.FreeBytes != 100<<20 || s.MinFreeBytes != 512<<20 || !s.Low {
		t.Fatalf("SpaceStats = %+v", s)
	}
	saveApplied(t, db, recordEntries(1, 10, 100, func(uint64) time.Time { return time.Now() }))
	disk.free.Store(1 << 30)
	waitLow(t, db, false)
	if why := db.RefusingReason(); why != "" {
		t.Fatalf("RefusingReason after space returned = %q", why)
	}
}

// The default watermark is 5 % of the filesystem or 256 MiB, whichever is
// smaller; a negative MinFree turns it off.
func TestMinFreeDefaultAndOff(t *testing.T) {
	if got := minFreeDefault(1 << 30); got != (1<<30)/20 {
		t.Errorf("default on 1 GiB = %d, want 5 %%", got)
	}
	if got := minFreeDefault(64 << 30); got != 256<<20 {
		t.Errorf("default on 64 GiB = %d, want 256 MiB", got)
	}
	disk := &fakeDisk{}
	disk.total.Store(1 << 30)
	disk.free.Store(10 << 20) // under 5 % of 1 GiB
	db := testOpen(t, t.TempDir(), &Options{FreeSpace: disk.statfs})
	waitLow(t, db, true)
	off := testOpen(t, t.TempDir(), &Options{MinFree: -1, FreeSpace: disk.statfs})
	if off.space.on() || off.LowOnSpace() {
		t.Fatal("MinFree -1 still watches the disk")
	}
}
