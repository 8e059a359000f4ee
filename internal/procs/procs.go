// Package procs runs the daemon on one Go processor (GOMAXPROCS 1) while
// it needs less than a core, and on all of them once it needs more.
//
// Why: Go's scheduler is work conserving. Each time a goroutine is made
// runnable while a processor is idle it wakes a second thread to look for
// that work, which the running thread usually takes itself; the woken
// thread spins, finds nothing and sleeps again (golang/go#54622). A
// gateway's ack path hands a message from a connection's read loop to the
// raft loop, to the log, to the applier and to the replication stream, so
// under a steady load each message pays a few of these futile wake-ups; on
// a virtual machine each is an inter-processor interrupt. On a 2-core VM a
// slave of a 3-gateway cluster spent 14–23 % less CPU per message on one
// processor (docs/benchmarks.md). One processor caps the daemon at about
// a core, though, so a fixed GOMAXPROCS=1 is no default: the governor
// watches the process's own CPU time and gives the processors back as soon
// as the one is mostly busy, then takes them away again once the load has
// stayed low for a while.
//
// An explicit GOMAXPROCS in the environment is the operator's choice and
// is left alone, as is a host with one processor.
package procs

import (
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of the governor the daemon runs.
const (
	// Interval is how often the process's CPU time is read.
	Interval = 250 * time.Millisecond
	// UpAt is the share of one core the process uses on one processor at
	// which it gets them all back: the one is then nearly always busy, and
	// the load may want more. W1 (50 devices acked one publish at a time,
	// as fast as a 2-core VM shared with the load generator goes) runs at
	// 0.6–0.76 of a core on one processor, with the same ack p99 as on
	// two.
	UpAt = 0.9
	// DownAt is the load, in cores, under which the process goes back to
	// one processor, once it has stayed there for Calm. It is below UpAt
	// by more than what the same load costs more on all processors (the
	// wake-ups above: 15–28 % on a 2-core VM), so that a load between the
	// two stays where it is instead of moving back and forth.
	DownAt = 0.7
	// Calm is how long the load must stay under DownAt: a burst (devices
	// reconnecting at once, a snapshot) is over before the processors are
	// taken away.
	Calm = time.Second
)

// running is set while a governor runs: GOMAXPROCS is the process's, and
// in-process tests may start several daemons, of which only the first
// governs.
var running atomic.Bool

// governor moves GOMAXPROCS between 1 and Max with the load.
type governor struct {
	Max      int           // processors under load: GOMAXPROCS as the runtime set it
	Interval time.Duration // between readings of the CPU time
	UpAt     float64       // cores used on one processor that bring Max back
	DownAt   float64       // cores used on Max under which it goes back to one, after Calm
	Calm     time.Duration
	// CPU reads the process's CPU time, user and system; ok is false
	// where it cannot.
	CPU func() (d time.Duration, ok bool)
	// Set sets GOMAXPROCS (runtime.GOMAXPROCS outside tests).
	Set func(n int)
	Log *slog.Logger

	procs    int           // as set last
	lastCPU  time.Duration // at the last reading
	lastAt   time.Time
	lowSince time.Time // since when the load is under DownAt; zero: it is not
}

// Start runs the daemon's governor until the returned stop is called, which
// gives the process its processors back. It does nothing (and stop does
// nothing) where GOMAXPROCS is set in the environment, the runtime has
// one processor, the CPU time cannot be read, or another governor runs.
func Start(log *slog.Logger) (stop func()) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if v := os.Getenv("GOMAXPROCS"); v != "" {
		log.Info("processors: GOMAXPROCS is set in the environment, the load does not move it", "procs", runtime.GOMAXPROCS(0), "GOMAXPROCS", v)
		return func() {}
	}
	if runtime.GOMAXPROCS(0) < 2 {
		return func() {}
	}
	if _, ok := processCPU(); !ok {
		return func() {}
	}
	if !running.CompareAndSwap(false, true) {
		return func() {}
	}
	g := &governor{
		Max: runtime.GOMAXPROCS(0), Interval: Interval, UpAt: UpAt, DownAt: DownAt, Calm: Calm,
		CPU: processCPU, Set: func(n int) { runtime.GOMAXPROCS(n) }, Log: log,
	}
	quit := make(chan struct{})
	var wg sync.WaitGroup
	g.begin(time.Now())
	// After begin, so that whoever reads this line finds one processor.
	log.Info("processors: one while the load needs less than a core, all of them beyond", "procs", g.Max)
	wg.Go(func() {
		t := time.NewTicker(g.Interval)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case now := <-t.C:
				g.tick(now)
			}
		}
	})
	var once sync.Once
	return func() {
		once.Do(func() {
			close(quit)
			wg.Wait()
			// The runtime's own choice again, which follows a
			// container's CPU limit as it changes.
			runtime.SetDefaultGOMAXPROCS()
			running.Store(false)
		})
	}
}

// begin takes the first reading and goes to one processor.
func (g *governor) begin(now time.Time) {
	g.procs = g.Max
	g.lastCPU, _ = g.CPU()
	g.lastAt = now
	g.set(1, "start")
}

// tick reads the CPU time and moves GOMAXPROCS if the load since the last
// reading calls for it.
func (g *governor) tick(now time.Time) {
	cpu, ok := g.CPU()
	wall := now.Sub(g.lastAt)
	if !ok || wall <= 0 {
		return
	}
	load := float64(cpu-g.lastCPU) / float64(wall)
	g.lastCPU, g.lastAt = cpu, now

	switch {
	case g.procs == 1 && load >= g.UpAt:
		g.set(g.Max, "load")
	case g.procs > 1 && load < g.DownAt:
		if g.lowSince.IsZero() {
			g.lowSince = now
		} else if now.Sub(g.lowSince) >= g.Calm {
			g.lowSince = time.Time{}
			g.set(1, "calm")
		}
	default:
		g.lowSince = time.Time{}
	}
}

func (g *governor) set(n int, why string) {
	if n == g.procs {
		return
	}
	g.Set(n)
	g.procs = n
	if g.Log != nil {
		g.Log.Debug("processors", "procs", n, "why", why)
	}
}
