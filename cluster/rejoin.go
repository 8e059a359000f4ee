package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tandem-edge/tandem/replication"

	"github.com/tandem-edge/tandem/internal/clock"
)

// The deposed master's side of a forced promotion (DESIGN.md, "Forced
// promotion forks the cluster"): it knocks on its lost members until one
// answers that it was promoted over it, then rejoins as that one's slave
// (promote.go: rejoin). The knock is what decides, so it must survive a
// slow link: it is retried with backoff, its timeout grows with the round
// trip measured to the peer, each failure is logged (rate-limited), and a
// master that learns of a higher generation any other way stops acking
// until it has rejoined.

// metaSuperseded is the highest cluster generation this node has learned of
// from an authenticated member while it was master of a lower one: it is
// fenced (takes no publishes) until it has rejoined, across restarts too.
const metaSuperseded = "cluster.superseded"

// Knock pacing. A knock opens a fresh connection: TCP, TLS 1.3 and the
// hellos take about three round trips, the request one more.
const (
	rejoinEvery      = 2 * time.Second  // between knocks, before backoff
	rejoinEveryMax   = 4 * time.Second  // the backoff's ceiling: rounds overlap, so this bounds the wait once answers get through
	knockRoundsMax   = 3                // knock rounds in flight at once
	knockTimeoutMin  = 4 * time.Second  // a knock's timeout, at least
	knockTimeoutMax  = 60 * time.Second // and at most
	knockRoundTrips  = 8                // a knock's timeout in measured round trips (about 2x what it costs)
	knockFailLogging = 30 * time.Second // failed knocks are logged at most this often
)

// rateLimit lets an event through at most once per interval.
type rateLimit struct{ last atomic.Int64 }

// allow reports whether the event may happen now, and if so counts it.
func (r *rateLimit) allow(every time.Duration) bool {
	now := int64(clock.Mono()) // a jump back of the wall clock must not mute it
	last := r.last.Load()
	return (last == 0 || now-last >= int64(every)) && r.last.CompareAndSwap(last, now)
}

// rttEstimate is a smoothed round trip to the other members (RFC 6298's
// SRTT), measured on requests over member links and on knocks.
type rttEstimate struct {
	mu   sync.Mutex    // guards srtt and last
	srtt time.Duration // 0 until measured
	last time.Duration // the latest sample
}

// observe adds one measured round trip.
func (r *rttEstimate) observe(d time.Duration) {
	if d <= 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.last = d
	if r.srtt == 0 {
		r.srtt = d
		return
	}
	r.srtt += (d - r.srtt) / 8
}

// get returns the estimate, 0 when nothing was measured.
func (r *rttEstimate) get() time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.srtt
}

// patience is the round trip a timeout should allow for: the estimate,
// or the latest sample when that is longer. The smoothed estimate takes
// about eight samples (the topic exchange's, one every 10 s) to follow a
// link that slowed down; a probe timed by it meanwhile gives up on a
// master that is only slow (CI: a 6 s probe on a 2 s round trip).
func (r *rttEstimate) patience() time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return max(r.srtt, r.last)
}

// knockTimeout is the patience for one knock after failures timed-out
// knocks in a row: knockRoundTrips round trips, growing by half with each
// timeout (the link may be slower than measured, or never measured).
func knockTimeout(rtt time.Duration, failures int) time.Duration {
	d := max(knockTimeoutMin, knockRoundTrips*rtt)
	for range min(failures, 8) {
		d += d / 2
	}
	return min(d, knockTimeoutMax)
}

// rejoinInterval is the wait before the next knock after failures.
func rejoinInterval(failures int) time.Duration {
	return min(rejoinEvery<<min(failures, 3), rejoinEveryMax)
}

// rejoinState is the deposed master's knocking, between keeper ticks.
//
// Knock rounds overlap: a new one starts every rejoinInterval even while
// an earlier one still waits out its (long, on a slow link) timeout, so
// that once answers get through again the next round is never further off
// than the interval. The promoted node answers them all alike.
type rejoinState struct {
	mu       sync.Mutex // guards failures and next
	failures int        // knock rounds in a row that got no answer
	next     time.Time  // no round before this
	log      rateLimit  // failed rounds logged
	now      atomic.Bool
	inFlight atomic.Int32 // rounds running
	stepMu   sync.Mutex   // one step-down at a time: rounds may succeed together
}

// due reports whether the keeper should knock now: the interval is over,
// or a hint (a higher generation seen) asks for it at once.
func (s *rejoinState) due() bool {
	if s.now.Swap(false) {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return !time.Now().Before(s.next)
}

// started schedules the round after the one starting now.
func (s *rejoinState) started() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.next = time.Now().Add(rejoinInterval(s.failures))
}

// done records the outcome of a round of knocks.
func (s *rejoinState) done(answered bool) (failures int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if answered {
		s.failures = 0
	} else {
		s.failures++
	}
	return s.failures
}

// attempts returns the knocks in a row without an answer.
func (s *rejoinState) attempts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failures
}

// knockRound starts a round of checkDeposed unless knockRoundsMax are
// running.
func (c *cluster) knockRound(ctx context.Context, lost []replication.Member) {
	if c.rejoins.inFlight.Add(1) > knockRoundsMax {
		c.rejoins.inFlight.Add(-1)
		return
	}
	c.rejoins.started()
	c.goFunc(func() {
		defer c.rejoins.inFlight.Add(-1)
		c.checkDeposed(ctx, lost)
	})
}

// checkDeposed runs on a master whose members are out of reach: it asks
// each whether it promoted itself meanwhile, and if one did, steps down:
// its raft state goes, what it logged after the fork is re-published on the
// new master, and it rejoins as the slave (DESIGN.md: the old master must
// not talk raft to the new one before that wipe; it never does, as it
// refuses member links from a higher generation).
func (c *cluster) checkDeposed(ctx context.Context, lost []replication.Member) {
	payload, _ := json.Marshal(JoinRequest{Rejoin: true, Member: c.d.self(), Gen: c.generation()})
	answered := false
	var lastErr error
	var lastAddr string
	timeout := knockTimeout(c.rtt.patience(), c.rejoins.attempts())
	for _, m := range lost {
		for _, addr := range c.peerAddrs(m) {
			kctx, cancel := context.WithTimeout(ctx, timeout)
			start := time.Now()
			reply, remote, err := c.tr.Knock(kctx, addr, m.Fingerprint, replication.KnockJoin, payload)
			cancel()
			if err == nil || errors.Is(err, replication.ErrRemote) {
				// A fresh connection and one request: four round trips.
				c.rtt.observe(time.Since(start) / 4)
				answered = true
			}
			if err != nil {
				if errors.Is(err, replication.ErrRemote) {
					break // it answered: not deposed by it, or not now
				}
				lastErr, lastAddr = err, addr
				continue
			}
			var rep JoinReply
			if json.Unmarshal(reply, &rep) != nil || rep.Generation <= c.generation() || remote.ID != m.ID {
				continue
			}
			c.rejoins.done(true)
			c.stepDown(rep, m)
			return
		}
	}
	failures := c.rejoins.done(answered || lastErr == nil)
	if lastErr == nil || !c.rejoins.log.allow(knockFailLogging) {
		return
	}
	level := c.d.log.Info
	if c.fenced() {
		level = c.d.log.Warn // promoted over: until a knock gets through, nobody takes this gateway's publishes
	}
	level("rejoin knock failed (asking an unreachable member whether it was promoted over this gateway); will retry", "addr", lastAddr, "attempts", failures, "timeout", timeout, "next_in", rejoinInterval(failures), "rtt", c.rtt.get().Round(time.Millisecond), "error", lastErr)
}

// stepDown rejoins as the slave of by, unless another knock round did
// meanwhile (rounds overlap, and the promoted node answers each alike).
func (c *cluster) stepDown(rep JoinReply, by replication.Member) {
	c.rejoins.stepMu.Lock()
	defer c.rejoins.stepMu.Unlock()
	if rep.Generation <= c.generation() {
		return
	}
	c.superseded(rep.Generation, "rejoin answer")
	c.rejoin(rep, by)
}

// superseded is how this node learns, from an authenticated member (its
// handshake, a knock's answer), that the cluster is at generation gen. A
// master of an older generation has been promoted over: it stops taking
// publishes (they would be acked on one disk only, for devices split from
// the rest) and knocks at once; it keeps knocking until it has rejoined.
func (c *cluster) superseded(gen uint64, source string) {
	if gen <= c.generation() {
		return
	}
	d := c.d
	if prev, _ := d.db.GetMeta(metaSuperseded); string(prev) != strconv.FormatUint(gen, 10) {
		if err := d.db.PutMeta(metaSuperseded, []byte(strconv.FormatUint(gen, 10))); err != nil {
			d.log.Warn("recording the higher generation failed", "error", err)
		}
		// News: knock now rather than at the next backoff step (but not
		// at every refused handshake after, or there would be no backoff).
		c.rejoins.now.Store(true)
	}
	c.fence(gen, source)
}

// fence stops this node taking publishes if it is the master and a higher
// generation is known; the keeper calls it each tick, so it also holds
// after a restart, and whenever this node elects itself again.
func (c *cluster) fence(gen uint64, source string) {
	n := c.d.node()
	if n == nil || n.Leader() != n.ID() || gen <= c.generation() {
		return
	}
	if n.Fence() {
		c.d.log.Warn("another gateway was promoted over this one: refusing publishes until it is the new master's slave", "generation", gen, "this_generation", c.generation(), "learned_from", source)
	}
}

// supersededGen returns metaSuperseded, 0 if none.
func (c *cluster) supersededGen() uint64 {
	v, _ := c.d.db.GetMeta(metaSuperseded)
	g, _ := strconv.ParseUint(string(v), 10, 64)
	return g
}

// fenced reports whether this node's replication is fenced.
func (c *cluster) fenced() bool {
	n := c.d.node()
	return n != nil && n.Fenced()
}

// probeReply answers a probe knock: the prober learns that this node is
// alive, and in which generation.
type probeReply struct {
	Cluster    string `json:"cluster"`
	Generation uint64 `json:"gen"`
	Master     bool   `json:"master"`
}

// probeTimeout bounds the probe a slave makes before promoting itself:
// enough for a fresh connection on the slowest link measured, and never
// less than failover_after.
func (c *cluster) probeTimeout(after time.Duration) time.Duration {
	return max(after, knockTimeout(c.rtt.patience(), 0))
}

// masterAnswers probes master, over the member link and by a knock on a
// fresh connection at once (a stalled TCP connection on a lossy link can
// hold what a new one carries): any answer, even a refusal, proves it
// alive.
func (c *cluster) masterAnswers(ctx context.Context, master replication.Member) bool {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Each probe with the round trips it costs.
	type probe struct {
		trips time.Duration
		run   func() error
	}
	var probes []probe
	if c.tr.Reachable(master.ID) {
		probes = append(probes, probe{1, func() error {
			_, err := c.tr.Request(ctx, master.ID, reqTopics, []byte(c.d.topicsHash()))
			return err
		}})
	}
	payload, _ := json.Marshal(JoinRequest{Probe: true, Member: c.d.self()})
	for _, addr := range c.peerAddrs(master) {
		probes = append(probes, probe{4, func() error {
			_, _, err := c.tr.Knock(ctx, addr, master.Fingerprint, replication.KnockJoin, payload)
			return err
		}})
	}
	alive := make(chan bool, len(probes))
	for _, p := range probes {
		// Tracked: the probes left running when one answers end with ctx.
		c.goFunc(func() {
			start := time.Now()
			err := p.run()
			ok := err == nil || errors.Is(err, replication.ErrRemote)
			if ok && ctx.Err() == nil {
				c.rtt.observe(time.Since(start) / p.trips)
			}
			alive <- ok
		})
	}
	for range probes {
		if <-alive {
			return true
		}
	}
	return false
}
