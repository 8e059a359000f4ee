package clock

import (
	"sync/atomic"
	"testing"
	"time"
)

// shifted is a wall clock a test moves: the host's plus shift.
func shifted() (*Clock, *atomic.Int64) {
	var shift atomic.Int64
	c := New(func() time.Time { return time.Now().Add(time.Duration(shift.Load())) })
	return c, &shift
}

const fiveYears = 5 * 365 * 24 * time.Hour

// TestJumpsAreAbsorbed: a jump of 5 years either way moves Now by no
// more than the time that passed, is counted, and told with its size.
func TestJumpsAreAbsorbed(t *testing.T) {
	for _, jump := range []time.Duration{fiveYears, -fiveYears, time.Hour, -2 * time.Second} {
		c, shift := shifted()
		var told []time.Duration
		c.OnJump(func(j, off time.Duration) { told = append(told, j) })
		before := c.Now()
		shift.Store(int64(jump))
		after := c.Now()
		if d := after.Sub(before); d < 0 || d > time.Second {
			t.Errorf("jump %v: Now moved by %v", jump, d)
		}
		if c.Jumps() != 1 || len(told) != 1 || (told[0]-jump).Abs() > time.Second {
			t.Errorf("jump %v: %d jumps, told %v", jump, c.Jumps(), told)
		}
		if off := c.Offset(); (off + jump).Abs() > time.Second {
			t.Errorf("jump %v: offset %v", jump, off)
		}
		// And time runs on from there as the monotonic clock does.
		time.Sleep(20 * time.Millisecond) // time passing is what is measured
		if d := c.Now().Sub(after); d < 20*time.Millisecond || d > time.Second {
			t.Errorf("jump %v: 20 ms later Now moved by %v", jump, d)
		}
	}
}

// TestSmallStepsAreNotJumps: a step within the tolerance is the wall
// clock's, not absorbed; Now never goes back for it.
func TestSmallStepsAreNotJumps(t *testing.T) {
	c, shift := shifted()
	a := c.Now()
	shift.Store(int64(-500 * time.Millisecond))
	b := c.Now()
	if c.Jumps() != 0 || c.Offset() != 0 {
		t.Fatalf("a 0.5 s step back: %d jumps, offset %v", c.Jumps(), c.Offset())
	}
	if b.Before(a) {
		t.Fatalf("Now went back: %v then %v", a, b)
	}
}

// TestRestore: a data dir's offset is taken up, and a wall clock behind
// the data dir's newest record (a board booted in 1970) is raised to it.
func TestRestore(t *testing.T) {
	c, _ := shifted()
	if off := c.Restore(-fiveYears, time.Time{}); off != -fiveYears {
		t.Fatalf("restored offset %v", off)
	}
	if d := time.Until(c.Now()) + fiveYears; d.Abs() > time.Second {
		t.Fatalf("Now is %v off the kept offset", d)
	}

	var shift atomic.Int64
	shift.Store(int64(-56 * 365 * 24 * time.Hour)) // booted in 1970
	newest := time.Now()
	c = New(func() time.Time { return time.Now().Add(time.Duration(shift.Load())) })
	off := c.Restore(0, newest)
	if got := c.Now(); got.Before(newest) || got.Sub(newest) > time.Second {
		t.Fatalf("Now %v, the newest record %v (offset %v)", got, newest, off)
	}
}

// TestHostClockFollowsTimeNow: a clock on the host's wall clock (New(nil),
// which takes both clocks from one time.Now) gives the time of day, never
// goes back and sees no jump where there is none.
func TestHostClockFollowsTimeNow(t *testing.T) {
	c := New(nil)
	prev := c.Now()
	for i := 0; i < 1000; i++ {
		before := time.Now()
		now := c.Now()
		after := time.Now()
		if now.Before(prev) {
			t.Fatalf("Now went back: %v then %v", prev, now)
		}
		if now.UnixNano() < before.UnixNano() || now.UnixNano() > after.UnixNano() {
			t.Fatalf("Now %v not between time.Now's %v and %v", now, before, after)
		}
		prev = now
	}
	if c.Jumps() != 0 || c.Offset() != 0 {
		t.Fatalf("%d jumps, offset %v, on a clock that did not jump", c.Jumps(), c.Offset())
	}
}
