package mqtt

import (
	"sync"
	"sync/atomic"
	"time"
)

// The gateway-wide memory account (DESIGN.md, "Budgets: what one device may
// take"; limits.memory).
//
// Every byte a client makes the gateway hold on its behalf is charged here
// while it is held: a publish from the moment it is read until the log has
// taken it or refused it (the record is encoded once more on its way, so it
// is charged twice its size), and what other parts of the broker hold for a
// client. Three marks follow from the limit, after EMQX's force_shutdown
// and HiveMQ's overload protection:
//   - any connection whose publishes waiting for the log reach
//     inboundShare of the limit is not read from until the log has taken
//     some (TCP back-pressure on that client only);
//   - past highMark, every connection that holds anything waiting is held
//     the same way: the heaviest clients stop, the light ones go on;
//   - at the limit, what waiting cannot fix is refused: a publish read then
//     gets 0x97 Quota exceeded (QoS 0: dropped and counted; MQTT 3.1.1,
//     which has no negative ack, is disconnected and resends later).
//
// An account with no limit charges nothing and holds nobody.
type memAccount struct {
	limit int64
	used  atomic.Int64

	mu     sync.Mutex    // guards relief
	relief chan struct{} // closed (and replaced) when used falls below highMark
}

// Shares of the limit, in 1/16ths.
const (
	highMark16     = 13 // 81 %: the heaviest connections stop being read
	inboundShare16 = 2  // 12.5 %: one connection's publishes waiting for the log
)

// memOverhead is what a publish costs beyond its topic and payload: the
// Message, its ack, the record's header and the raft entry around it.
const memOverhead = 512

// memRecheck is how often a connection held for memory looks again
// whether it has ended or the account moved without a signal.
const memRecheck = 100 * time.Millisecond

func newMemAccount(limit int64) *memAccount {
	return &memAccount{limit: limit, relief: make(chan struct{})}
}

func (m *memAccount) on() bool { return m != nil && m.limit > 0 }

func (m *memAccount) high() int64 { return m.limit / 16 * highMark16 }

// full reports whether the account is at its limit.
func (m *memAccount) full() bool { return m.on() && m.used.Load() >= m.limit }

// charge adds n bytes.
func (m *memAccount) charge(n int64) {
	if m.on() {
		m.used.Add(n)
	}
}

// release takes n bytes off, and signals the connections held for memory
// when that brings the account below its high mark.
func (m *memAccount) release(n int64) {
	if !m.on() {
		return
	}
	after := m.used.Add(-n)
	if after < m.high() && after+n >= m.high() {
		m.mu.Lock()
		close(m.relief)
		m.relief = make(chan struct{})
		m.mu.Unlock()
	}
}

// reliefC is closed the next time the account falls below its high mark.
func (m *memAccount) reliefC() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.relief
}

// MemoryUsed is the bytes clients make the gateway hold now (limits.memory's
// account), for status and metrics.
func (s *Server) MemoryUsed() int64 { return s.mem.used.Load() }

// HeldForMemory is how many connections are not read from now because
// of the memory account.
func (s *Server) HeldForMemory() int64 { return s.memHeld.Load() }

// publishCost is what a publish of this size is charged while it waits.
func publishCost(topic, payload int) int64 { return int64(2*(topic+payload) + memOverhead) }

// inboundHeld is what this connection's publishes waiting for the log hold.
func (c *conn) inboundHeld() int64 { return c.heldIn.Load() }

// chargeIn charges a publish read from this connection and returns what it
// charged (0 without a budget), for releaseIn once the log has taken or
// refused it. No closure: this is the publish path.
func (c *conn) chargeIn(cost int64) int64 {
	m := c.srv.mem
	if !m.on() {
		return 0
	}
	m.charge(cost)
	c.heldIn.Add(cost)
	return cost
}

// releaseIn gives back what chargeIn charged, and wakes the read loop if
// it waits for this connection's share.
func (c *conn) releaseIn(cost int64) {
	if cost == 0 {
		return
	}
	m := c.srv.mem
	m.release(cost)
	if c.heldIn.Add(-cost) < m.limit/16*inboundShare16 {
		select {
		case c.memSig <- struct{}{}:
		default:
		}
	}
}

// waitMemory holds the read loop while this connection holds too much of
// the account, or the gateway is near its limit and this connection holds
// anything waiting for the log: its client feels TCP back-pressure, no
// other does. It returns false once the connection has ended meanwhile.
// It runs before every packet read: the usual answer, go on, costs two
// loads and no defer (holdForMemory has the waiting).
func (c *conn) waitMemory() bool {
	m := c.srv.mem
	if !m.on() || c.memClear(m) {
		return true
	}
	return c.holdForMemory(m)
}

// memClear reports whether this connection may be read from now.
func (c *conn) memClear(m *memAccount) bool {
	mine := c.heldIn.Load()
	return mine == 0 || (mine < m.limit/16*inboundShare16 && m.used.Load() < m.high())
}

// holdForMemory waits until memClear, the connection ends (false) or the
// server stops (false).
func (c *conn) holdForMemory(m *memAccount) bool {
	tick := time.NewTicker(memRecheck)
	defer tick.Stop()
	c.srv.memHeld.Add(1)
	defer c.srv.memHeld.Add(-1)
	for !c.memClear(m) {
		relief := m.reliefC()
		select {
		case <-c.memSig:
		case <-relief:
		case <-tick.C:
		case <-c.srv.stopc:
			return false
		}
		if c.isEnded() {
			return false
		}
	}
	return true
}
