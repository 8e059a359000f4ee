package procs

import (
	"runtime"
	"slices"
	"testing"
	"time"
)

// fake is a governor on a CPU clock the test advances.
type fake struct {
	g   *governor
	cpu time.Duration
	now time.Time
	set []int
}

func newFake(max int) *fake {
	f := &fake{now: time.Unix(1000, 0)}
	f.g = &governor{
		Max: max, Interval: Interval, UpAt: UpAt, DownAt: DownAt, Calm: Calm,
		CPU: func() (time.Duration, bool) { return f.cpu, true },
		Set: func(n int) { f.set = append(f.set, n) },
	}
	f.g.begin(f.now)
	return f
}

// run spends load cores for d, one reading an Interval.
func (f *fake) run(load float64, d time.Duration) {
	for end := f.now.Add(d); f.now.Before(end); {
		f.now = f.now.Add(f.g.Interval)
		f.cpu += time.Duration(load * float64(f.g.Interval))
		f.g.tick(f.now)
	}
}

func TestGovernorStartsOnOneProcessor(t *testing.T) {
	f := newFake(4)
	if f.g.procs != 1 || len(f.set) != 1 || f.set[0] != 1 {
		t.Fatalf("after start: procs %d, set %v; want 1, [1]", f.g.procs, f.set)
	}
	f.run(0.5, 10*time.Second)
	if f.g.procs != 1 || len(f.set) != 1 {
		t.Fatalf("half a core for 10 s: procs %d after %d changes; want 1 after 1", f.g.procs, len(f.set))
	}
}

func TestGovernorGivesAllProcessorsBackOnceOneIsBusy(t *testing.T) {
	f := newFake(4)
	f.run(0.95, f.g.Interval)
	if f.g.procs != 4 {
		t.Fatalf("one processor 95 %% busy for one reading: procs %d, want 4", f.g.procs)
	}
	// A load that needs more than the one, now spread over four, keeps
	// them: it is above DownAt.
	f.run(2.5, 10*time.Second)
	if f.g.procs != 4 || len(f.set) != 2 {
		t.Fatalf("2.5 cores: procs %d after %d changes; want 4 after 2", f.g.procs, len(f.set))
	}
}

func TestGovernorGoesBackToOneOnlyAfterACalm(t *testing.T) {
	f := newFake(2)
	f.run(1.0, f.g.Interval)
	if f.g.procs != 2 {
		t.Fatalf("saturated: procs %d, want 2", f.g.procs)
	}
	// Low, but shorter than Calm, then a reading above DownAt: the calm
	// starts again.
	f.run(0.2, f.g.Calm-f.g.Interval)
	f.run(0.8, f.g.Interval)
	f.run(0.2, f.g.Calm-f.g.Interval)
	if f.g.procs != 2 {
		t.Fatalf("two calms cut short: procs %d, want 2", f.g.procs)
	}
	f.run(0.2, 2*f.g.Interval)
	if f.g.procs != 1 {
		t.Fatalf("low for longer than Calm: procs %d, want 1", f.g.procs)
	}
	if want := []int{1, 2, 1}; !slices.Equal(f.set, want) {
		t.Fatalf("GOMAXPROCS set to %v, want %v", f.set, want)
	}
}

// A load between DownAt on all processors and UpAt on one stays where it
// is, whichever it is on: the gap is wider than what the processors'
// wake-ups add to a message's cost, so the governor does not move back and
// forth.
func TestGovernorLoadBetweenTheThresholdsStaysPut(t *testing.T) {
	f := newFake(2)
	f.run(0.8, 10*time.Second)
	if f.g.procs != 1 {
		t.Fatalf("0.8 of a core on one: procs %d, want 1", f.g.procs)
	}
	f.run(0.95, f.g.Interval)
	f.run(0.8, 10*time.Second)
	if f.g.procs != 2 || len(f.set) != 2 {
		t.Fatalf("0.8 of a core on two: procs %d after %d changes; want 2 after 2", f.g.procs, len(f.set))
	}
}

func TestGovernorIgnoresAReadingItCannotTake(t *testing.T) {
	f := newFake(2)
	f.g.CPU = func() (time.Duration, bool) { return 0, false }
	f.run(1.0, time.Second)
	if f.g.procs != 1 {
		t.Fatalf("no CPU time to read: procs %d, want 1 (unchanged)", f.g.procs)
	}
}

// Start leaves an operator's GOMAXPROCS alone; without one it governs the
// process once, however many daemons a test process starts, and stop
// gives the runtime its own choice back.
func TestStartGovernsTheProcessOnce(t *testing.T) {
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("one processor: there is nothing to govern (needs 2 CPUs)")
	}
	before := runtime.GOMAXPROCS(0)

	t.Setenv("GOMAXPROCS", "2")
	Start(nil)()
	if got := runtime.GOMAXPROCS(0); got != before {
		t.Fatalf("with GOMAXPROCS in the environment: %d processors, want %d", got, before)
	}

	t.Setenv("GOMAXPROCS", "")
	stop := Start(nil)
	if got := runtime.GOMAXPROCS(0); got != 1 {
		stop()
		t.Fatalf("governed and idle: %d processors, want 1", got)
	}
	second := Start(nil)
	second()
	if got := runtime.GOMAXPROCS(0); got != 1 {
		stop()
		t.Fatalf("after a second governor's stop: %d processors, want 1 (the first still governs)", got)
	}
	stop()
	if got := runtime.GOMAXPROCS(0); got != before {
		t.Fatalf("after stop: %d processors, want the runtime's %d", got, before)
	}
	if running.Load() {
		t.Fatal("stopped, yet a governor is marked running")
	}
}
