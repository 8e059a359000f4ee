package replication

import (
	"net"
	"sync"
)

// Admission to the peer port. The port faces the LAN and must take
// strangers (a join or pairing knock), so what a stranger may hold there
// is bounded three ways:
//   - per source address: a few handshakes and one knock at a time, so one
//     host flooding the port takes a few slots, not all of them;
//   - in time: the hello must arrive within firstHelloTimeout of the
//     accept and the knock frame within knockFrameTimeout of the hello, so
//     a stalled socket gives its slot back in seconds;
//   - by reservation: slots beyond the shared ones are kept for member
//     hosts (the hosts of the members' addresses and those their links last
//     came from), so a flood from many addresses still leaves the members
//     a way in. Member hosts are not held to the per-source bounds: every
//     gateway of a test or a lab may share one address.
// Before TLS completes nothing but the source address is known; that is
// what admission goes by. The fingerprint check after it is what
// authenticates.

// srcLimiter counts what is held, in all and per source address.
type srcLimiter struct {
	shared   int // slots anyone may take
	reserved int // more slots only member hosts may take
	perSrc   int // slots one non-member source may hold

	mu    sync.Mutex
	n     int
	bySrc map[string]int
}

func newSrcLimiter(shared, reserved, perSrc int) *srcLimiter {
	return &srcLimiter{shared: shared, reserved: reserved, perSrc: perSrc, bySrc: map[string]int{}}
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

// release gives back a slot acquire gave src.
func (l *srcLimiter) release(src string) {
	src = sourceKey(src)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n--
	if l.bySrc[src]--; l.bySrc[src] <= 0 {
		delete(l.bySrc, src) // the map holds only sources holding slots
	}
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
