package replication

import (
	"net"
	"slices"
	"sync"
	"time"
)

// Admission to the peer port. The port faces the LAN and must take
// strangers (a join or pairing knock), so what strangers may hold there is
// bounded, and shared so that no set of them can lock out a real join:
//   - stranger slots: every accepted connection holds one from the accept
//     until it proves to be a member's (its certificate's fingerprint is
//     pinned and its hello matches: the slot is given back at once) or
//     until its knock is answered. There are maxStrangers of them
//     (peer.max_strangers, 64), at most perSource for one source address
//     (peer.max_strangers_per_address, 2), so it takes 32 addresses to
//     fill them;
//   - eviction when they are full: a newcomer from an address holding no
//     slot takes the slot of the oldest connection of the address holding
//     the most, if that is more than one (never one whose knock is being
//     answered, never an address's only slot). So a real
//     joiner from a fresh address always gets a slot at once, and keeps it
//     while any address holds more than its one; an attacker must bring
//     ever new addresses to take slots back, and with every address
//     holding one, as many new addresses as there are slots before the
//     joiner's is the oldest, where the joiner needs one round trip and a
//     TLS handshake. Newcomers from addresses that hold a slot already are
//     refused, not let in by eviction: a flood from a fixed set of
//     addresses settles, instead of churning TLS handshakes;
//   - in time: the hello must arrive within firstHelloTimeout of the
//     accept and the knock frame within knockFrameTimeout of the hello, so
//     a stalled socket gives its slot back in seconds anyway (a member
//     host has handshakeTimeout for each: acceptPatience);
//   - members first: connections from member hosts (the hosts of the
//     members' addresses and those their links last came from) are held
//     to no per-source bound (every gateway of a test or a lab may share
//     one address), may always evict a stranger, are never evicted, and
//     have reservedStrangers more slots when no stranger can be evicted;
//     a member from any other host is a stranger until its hello, which
//     takes it a round trip, and is then no longer counted.
//   - answering: at most maxKnocks knocks are handled at once (one per
//     source); a knock waits for its turn rather than being refused, as
//     handlers answer strangers in milliseconds.
// Before TLS completes nothing but the source address is known; that is
// what admission goes by. The fingerprint check after it is what
// authenticates.

// Reasons a stranger connection is refused or closed by admission, the
// labels of tandem_peer_stranger_refusals_total.
const (
	refusedPerSource = iota // its address held perSource slots already
	refusedFull             // every slot held, none it may evict
	refusedEvicted          // a newcomer took its slot
	numRefusals
)

// StrangerRefusals names the reasons TransportStats.StrangerRefusals
// counts, in its order.
var StrangerRefusals = [numRefusals]string{"per_address", "full", "evicted"}

// strangerSlot is one accepted connection not yet proven a member's.
type strangerSlot struct {
	src     string    // sourceKey of its host
	addr    string    // host:port, for the log
	at      time.Time // accepted at
	member  bool      // from a member host: never evicted
	nc      net.Conn  // closed by an eviction
	evicted chan struct{}

	busy bool // its knock is being answered: never evicted; guarded by the slots' mu
	gone bool // released or evicted; guarded by the slots' mu
}

// strangerSlots is the table of the slots held.
type strangerSlots struct {
	max, perSrc, reserved int

	mu    sync.Mutex
	held  []*strangerSlot // in the order taken: oldest first
	bySrc map[string]int  // slots held per source; only sources holding some
}

func newStrangerSlots(max, perSrc, reserved int) *strangerSlots {
	return &strangerSlots{max: max, perSrc: perSrc, reserved: reserved, bySrc: map[string]int{}}
}

// admit takes a slot for nc from host, a member host or not. When all are
// held it evicts the slot evictable() picks, which it returns for the
// caller to close and log (its connection is closed here already). A nil
// slot means refused, for the reason given.
func (s *strangerSlots) admit(nc net.Conn, host string, member bool, now time.Time) (slot, victim *strangerSlot, why int) {
	src := sourceKey(host)
	s.mu.Lock()
	defer s.mu.Unlock()
	if !member && s.bySrc[src] >= s.perSrc {
		return nil, nil, refusedPerSource
	}
	if len(s.held) >= s.max {
		victim = s.evictable(src, member)
		switch {
		case victim != nil:
			s.dropLocked(victim)
			close(victim.evicted)
			victim.nc.Close()
		case !member || len(s.held) >= s.max+s.reserved:
			return nil, nil, refusedFull
		}
	}
	slot = &strangerSlot{src: src, addr: nc.RemoteAddr().String(), at: now, member: member, nc: nc, evicted: make(chan struct{})}
	s.held = append(s.held, slot)
	s.bySrc[src]++
	return slot, victim, 0
}

// evictable picks the slot a newcomer from src may take: the oldest of the
// source holding the most slots (the one whose oldest is oldest among
// equals), if src holds none; a member host's newcomer takes it whatever
// src holds. Slots of member hosts and slots whose knock is being answered
// are never taken. Nil when none may be.
func (s *strangerSlots) evictable(src string, member bool) *strangerSlot {
	if !member && s.bySrc[src] > 0 {
		return nil
	}
	var victim *strangerSlot
	// A stranger newcomer takes a slot only from an address holding more
	// than one: taking an address's only slot would trade one address for
	// another, and would let a flood of fresh addresses evict a real
	// joiner whose TLS handshake is slow (under -race on a loaded machine
	// it took over 2 s, and the churning flood took its slot meanwhile).
	most := 1
	if member {
		most = 0
	}
	for _, sl := range s.held { // oldest first: the first of a source is its oldest
		if sl.member || sl.busy || sl.src == src {
			continue
		}
		if n := s.bySrc[sl.src]; n > most {
			victim, most = sl, n
		}
	}
	return victim
}

// dropLocked removes sl from the table.
func (s *strangerSlots) dropLocked(sl *strangerSlot) {
	sl.gone = true
	s.held = slices.DeleteFunc(s.held, func(x *strangerSlot) bool { return x == sl })
	if s.bySrc[sl.src]--; s.bySrc[sl.src] <= 0 {
		delete(s.bySrc, sl.src)
	}
}

// release gives sl back; nothing if it was given back or evicted already.
func (s *strangerSlots) release(sl *strangerSlot) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !sl.gone {
		s.dropLocked(sl)
	}
}

// answering marks sl's knock as being answered, which no eviction
// interrupts; false if sl was evicted already.
func (s *strangerSlots) answering(sl *strangerSlot) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sl.gone {
		return false
	}
	sl.busy = true
	return true
}

// wasEvicted reports whether a newcomer took sl.
func (sl *strangerSlot) wasEvicted() bool {
	select {
	case <-sl.evicted:
		return true
	default:
		return false
	}
}

// counts is how many slots are held, and by how many sources.
func (s *strangerSlots) counts() (held, sources int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.held), len(s.bySrc)
}

// srcLimiter counts what is held, in all and per source address.
type srcLimiter struct {
	shared   int // slots anyone may take
	reserved int // more slots only member hosts may take
	perSrc   int // slots one non-member source may hold

	mu    sync.Mutex
	n     int
	bySrc map[string]int
	freed chan struct{} // closed and replaced by each release: waiters look again
}

func newSrcLimiter(shared, reserved, perSrc int) *srcLimiter {
	return &srcLimiter{shared: shared, reserved: reserved, perSrc: perSrc, bySrc: map[string]int{}, freed: make(chan struct{})}
}

// acquire takes a slot for source host src; false means none is free for
// it.
func (l *srcLimiter) acquire(src string, member bool) bool {
	src = sourceKey(src)
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case member && l.n < l.shared+l.reserved:
	case member:
		return false
	case l.bySrc[src] >= l.perSrc, l.n >= l.shared:
		return false
	}
	l.n++
	l.bySrc[src]++
	return true
}

// acquireWait is acquire that waits for a slot until deadline, or until
// stop or gone is closed.
func (l *srcLimiter) acquireWait(src string, member bool, deadline time.Time, stop, gone <-chan struct{}) bool {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for {
		l.mu.Lock()
		freed := l.freed
		l.mu.Unlock()
		if l.acquire(src, member) {
			return true
		}
		select {
		case <-freed:
		case <-timer.C:
			return false
		case <-stop:
			return false
		case <-gone:
			return false
		}
	}
}

// release gives back a slot acquire gave src.
func (l *srcLimiter) release(src string) {
	src = sourceKey(src)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n--
	if l.bySrc[src]--; l.bySrc[src] <= 0 {
		delete(l.bySrc, src) // the map holds only sources holding slots
	}
	close(l.freed)
	l.freed = make(chan struct{})
}

// sourceKey is what the per-source bounds count by: the address, or for
// IPv6 its /64, which one host may hold whole (mqtt's connect_rate counts
// the same way).
func sourceKey(host string) string {
	ip := net.ParseIP(host)
	if ip == nil || ip.To4() != nil {
		return host
	}
	return ip.Mask(net.CIDRMask(64, 128)).String() + "/64"
}

// hostOf is the host part of a "host:port" address (the address itself
// when it has no port).
func hostOf(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return h
	}
	return addr
}

// acceptPatience is how long an accepted connection may take for each
// step strangers get only stranger for (the TLS handshake and the first
// hello; the knock frame after it); member says it comes from a member
// host (memberHost), which gets handshakeTimeout, what the dialling side
// allows itself. A stranger's short limits keep a stalled socket from
// holding a slot, but each step costs the dialler a round trip: on a link
// with a second of one-way delay (satellite, a congested cellular uplink)
// a member's redial or a failover probe could never finish within them,
// and a member link once dropped would never come back. Member hosts are
// trusted with it as they are with their number of slots (no per-source
// bound).
func acceptPatience(member bool, stranger time.Duration) time.Duration {
	if member {
		return handshakeTimeout
	}
	return stranger
}

// memberHost reports whether host is where a member may dial from: the
// host of one of its addresses, or where its last link came from.
func (t *PeerTransport) memberHost(host string) bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if _, ok := t.seenHosts[host]; ok {
		return true
	}
	for _, p := range t.peers {
		p.mu.Lock()
		for _, a := range p.addrs {
			if hostOf(a) == host {
				p.mu.Unlock()
				return true
			}
		}
		p.mu.Unlock()
	}
	return false
}

// sawMember notes that member id's link came from host.
func (t *PeerTransport) sawMember(id uint64, host string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed || t.peers[id] == nil {
		return
	}
	for h, pid := range t.seenHosts {
		if pid == id && h != host {
			delete(t.seenHosts, h) // one host per member: the map stays small
		}
	}
	t.seenHosts[host] = id
}
