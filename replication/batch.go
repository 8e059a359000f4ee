package replication

import (
	"sync/atomic"
	"time"
)

// groupCommit decides when the raft goroutine takes the queued proposals
// into a commit. Every commit costs a WAL write and its fdatasync, which on
// small gateways cost more CPU than the records they carry, so records per
// commit decide the CPU per publish.
//
// Publishers are mostly closed loops: a client with a window of w sends its
// next publish when an ack comes back. Taking the queue the moment the last
// commit ends splits them into cohorts that alternate (while one commits, the
// other turns its acks around), each commit carrying a fraction of them. So
// the gate estimates the population of such publishes (peak: the most
// proposals that were in the node at once) and, while fewer are in, waits
// for the rest, at most twice their usual turnaround. A lone client with
// window 1 has a population of one and never waits; clients that leave cost
// a few waits, each of which moves the estimate half way down to what came
// back (one slow straggler must not halve the next commits; a population of
// 64 that drops to 1 costs 6 waits).
//
// Safety is untouched: a proposal is acked after the commit that holds it,
// as before; the gate only chooses how long a queue may grow first.
type groupCommit struct {
	inNode atomic.Int64 // proposals enqueued and not yet resolved
	target atomic.Int64 // take the queue once inNode reaches this
	// hurry makes the next take go at once: a slave's forward batch is a
	// cohort of its own, and the rest of its population waits on the
	// slave for this batch's answers, so waiting for it never fills up.
	hurry atomic.Bool

	// Loop-owned.
	peak      int64         // estimated closed-loop population
	waitStart time.Time     // when the current wait began; zero when not waiting
	waitFor   time.Duration // how long the current wait may last
	turn      time.Duration // moving average of the waits that filled up
	timer     *time.Timer
}

// Bounds of a wait: the population's turnaround measured on the waits that
// filled up, twice over, within [minBatchWait, maxBatchWait]. An idle
// gateway turns acks around in well under a millisecond; a loaded one
// (where batching matters most) takes longer.
const (
	minBatchWait = 200 * time.Microsecond
	maxBatchWait = 5 * time.Millisecond
)

// arrived counts a proposal put in the queue, which now holds queued; it
// reports whether the loop must be woken: for the first one (to take it or
// start waiting) and when the population is in.
func (g *groupCommit) arrived(queued int) bool {
	c := g.inNode.Add(1)
	return queued == 1 || c >= g.target.Load()
}

// now makes the next take go at once, whatever the population.
func (g *groupCommit) now() { g.hurry.Store(true) }

// left counts a proposal resolved.
func (g *groupCommit) left() { g.inNode.Add(-1) }

// take reports whether the loop should take the queue now. When it should
// wait, wake is arranged to be called once the wait is over.
func (g *groupCommit) take(now time.Time, leader bool, wake func()) bool {
	c := g.inNode.Load()
	switch {
	case !leader || c >= g.target.Load() || g.hurry.Swap(false):
		if !g.waitStart.IsZero() {
			g.turn += (now.Sub(g.waitStart) - g.turn) / 8
		}
		g.peak = max(g.peak, c)
	case g.waitStart.IsZero():
		g.waitStart = now
		g.waitFor = min(max(2*g.turn, minBatchWait), maxBatchWait)
		if g.timer == nil {
			g.timer = time.AfterFunc(g.waitFor, wake)
		} else {
			g.timer.Reset(g.waitFor)
		}
		return false
	case now.Sub(g.waitStart) < g.waitFor:
		g.timer.Reset(g.waitFor - now.Sub(g.waitStart)) // a wake-up must stay due
		return false
	default:
		// The rest did not come: they left, or are slower than that.
		g.turn += (now.Sub(g.waitStart) - g.turn) / 8
		g.peak -= (g.peak - c + 1) / 2 // c < target = peak here
	}
	g.waitStart = time.Time{}
	g.target.Store(max(1, g.peak))
	return true
}
