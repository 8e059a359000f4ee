// Package clock is the gateway's time of day with the wall clock's jumps
// taken out (DESIGN.md, "Time").
//
// Gateways without a real-time clock (a Raspberry Pi) boot with a wrong
// wall clock and jump, by years either way, when NTP syncs; an operator
// may set the date by hand. Durations never read the wall clock: they use
// Go's monotonic readings, or Mono for a duration kept in an atomic. What
// is measured against record times (storage.max_age, message expiry, lag
// in seconds) reads Now: the wall clock plus an offset that absorbs every
// jump the clock detects, so that the time it gives runs on as the
// monotonic clock does. A jump of 5 years forward therefore ages no
// record by 5 years, and one back expires nothing late by 5 years.
//
// A jump is a difference, between two readings, of the wall clock's
// advance and the monotonic clock's larger than JumpTolerance plus 0.1 %
// of the interval (NTP's slewing stays far below that). The offset is
// kept across restarts by the data dir (storage persists and restores
// it, see Restore), and Now never goes below the newest record a data dir
// holds: a gateway that boots in 1970 stamps its next records after its
// last ones.
//
// The price: after a jump the log's time of day differs from the host's
// by what was absorbed (status and metrics show it, and the log says it at
// the jump). It is the price of never dropping or expiring data for a
// clock's mistake; which of the two clocks was right cannot be told.
package clock

import (
	"sync"
	"sync/atomic"
	"time"
)

// JumpTolerance is the least difference between the wall clock's advance
// and the monotonic clock's that counts as a jump.
const JumpTolerance = time.Second

// Clock is a time of day with jumps absorbed. Its zero value is not
// usable; New makes one. Safe for concurrent use.
type Clock struct {
	wall func() time.Time // the host's time of day
	host bool             // wall is time.Now: one reading has both clocks
	base time.Time        // a monotonic reading at New

	mu       sync.Mutex // guards the fields below
	lastMono time.Duration
	lastWall int64 // Unix ns of the last wall reading
	offset   int64 // ns added to the wall clock
	last     int64 // the last time Now returned, Unix ns
	onJump   func(jump, offset time.Duration)

	jumps   atomic.Uint64
	offsetA atomic.Int64 // offset, for readers that take no lock

	raw bool // detect jumps but follow them: a test build's control (testshift.go)
}

// New returns a clock reading wall (time.Now when nil) for the time of
// day; the monotonic clock is always the process's.
func New(wall func() time.Time) *Clock {
	host := wall == nil
	if host {
		wall = time.Now
	}
	c := &Clock{wall: wall, host: host, base: time.Now()}
	c.lastWall = wall().UnixNano()
	return c
}

// Default is the process's clock: what the gateway stamps records with
// and measures them against.
var Default = New(nil)

// Now returns Default's time of day.
func Now() time.Time { return Default.Now() }

// Mono returns the time since the process started on the monotonic
// clock, for durations kept as a number (in an atomic): a wall-clock
// jump neither stalls nor fires them.
func Mono() time.Duration { return time.Since(Default.base) }

// Now returns the time of day: the wall clock plus the offset of every
// jump absorbed, never before the last time it returned. It carries no
// monotonic reading (it is meant to be compared with record times).
func (c *Clock) Now() time.Time {
	var mono time.Duration
	var w int64
	if c.host {
		// time.Now carries the wall and the monotonic clock both: one
		// reading, where time.Since and the wall func would take two
		// (the publish path stamps every message with Now).
		t := time.Now()
		mono, w = t.Sub(c.base), t.UnixNano()
	} else {
		mono = time.Since(c.base)
		w = c.wall().UnixNano()
	}
	c.mu.Lock()
	dm := mono - c.lastMono
	skew := time.Duration(w-c.lastWall) - dm
	var hook func(jump, offset time.Duration)
	if skew > JumpTolerance+dm/1000 || -skew > JumpTolerance+dm/1000 {
		if !c.raw {
			c.offset -= int64(skew)
			c.offsetA.Store(c.offset)
		}
		c.jumps.Add(1)
		hook = c.onJump
	}
	c.lastMono, c.lastWall = mono, w
	t := w + c.offset
	if !c.raw {
		t = max(t, c.last)
	}
	c.last = t
	off := time.Duration(c.offset)
	c.mu.Unlock()
	if hook != nil {
		hook(skew, off)
	}
	return time.Unix(0, t)
}

// Offset is what Now adds to the wall clock: the jumps absorbed, negated.
func (c *Clock) Offset() time.Duration { return time.Duration(c.offsetA.Load()) }

// Jumps counts the jumps absorbed since the start.
func (c *Clock) Jumps() uint64 { return c.jumps.Load() }

// OnJump sets what is told of each jump (the wall clock's advance less the
// monotonic clock's, and the offset now), outside the clock's lock.
func (c *Clock) OnJump(f func(jump, offset time.Duration)) {
	c.mu.Lock()
	c.onJump = f
	c.mu.Unlock()
}

// Restore takes up a data dir's clock: offset is the one it kept, and
// Now will not go below floor (its newest record's time). It returns the
// offset in force, larger than the kept one when the wall clock is behind
// the floor: the host booted with its clock behind, which is absorbed like
// a jump back. It is called once, before the clock stamps anything.
func (c *Clock) Restore(offset time.Duration, floor time.Time) time.Duration {
	c.Now() // a jump before the restore is the process's own
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.jumps.Load() == 0 {
		c.offset = int64(offset)
	}
	if f := floor.UnixNano(); !floor.IsZero() && c.lastWall+c.offset < f {
		c.offset = f - c.lastWall
	}
	c.offsetA.Store(c.offset)
	c.last = c.lastWall + c.offset // before anything is stamped: it may go back
	return time.Duration(c.offset)
}
