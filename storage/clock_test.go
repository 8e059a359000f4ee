package storage

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/clock"
)

// shiftedClock is a clock whose wall clock a test moves.
func shiftedClock(shift *atomic.Int64) *clock.Clock {
	return clock.New(func() time.Time { return time.Now().Add(time.Duration(shift.Load())) })
}

// TestDataDirKeepsTheClock: a jump absorbed before a restart stays
// absorbed after it, and a host whose wall clock is behind the data dir's
// last checkpoint (booted in 1970) starts its clock from there.
func TestDataDirKeepsTheClock(t *testing.T) {
	dir := t.TempDir()
	var shift atomic.Int64
	c := shiftedClock(&shift)
	db := testOpen(t, dir, &Options{Clock: c})
	c.Now()
	shift.Store(int64(5 * 365 * 24 * time.Hour)) // NTP, five years on
	before := c.Now()
	if c.Jumps() != 1 {
		t.Fatalf("%d jumps", c.Jumps())
	}
	mustCheckpoint(t, db)
	mustClose(t, db)

	// The next process, on the same shifted wall clock.
	c2 := shiftedClock(&shift)
	db = testOpen(t, dir, &Options{Clock: c2})
	if c2.Offset() != c.Offset() {
		t.Fatalf("offset %v after a restart, %v before", c2.Offset(), c.Offset())
	}
	if d := c2.Now().Sub(before); d < 0 || d > 5*time.Second {
		t.Fatalf("the clock moved by %v across a restart", d)
	}
	mustCheckpoint(t, db)
	mustClose(t, db)

	// A board that boots in 1970, with no jump seen yet.
	var boot atomic.Int64
	boot.Store(-int64(56 * 365 * 24 * time.Hour))
	c3 := shiftedClock(&boot)
	testOpen(t, dir, &Options{Clock: c3})
	if got := c3.Now(); got.Before(before) {
		t.Fatalf("a clock booted in 1970 reads %v, before the data dir's last checkpoint %v", got, before)
	}
}
