package mqtt

import (
	"sync"

	"github.com/mochi-mqtt/server/v2/packets"
)

// connCounts counts the connected clients of each source address and each
// user, for max_connections_per_address and max_connections_per_user: one
// device, or one leaked password, may not take every connection slot.
type connCounts struct {
	mu     sync.Mutex     // guards byAddr, byUser
	byAddr map[string]int // by sourceKey; no entry for 0
	byUser map[string]int // by user name; no entry for 0
}

// take counts one more connection under key in *m (byAddr or byUser)
// unless it has max already.
func (n *connCounts) take(m *map[string]int, key string, max int) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if (*m)[key] >= max {
		return false
	}
	if *m == nil {
		*m = map[string]int{}
	}
	(*m)[key]++
	return true
}

// give uncounts a connection take counted.
func (n *connCounts) give(m *map[string]int, key string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if (*m)[key]--; (*m)[key] <= 0 {
		delete(*m, key)
	}
}

// takeAddrSlot counts c under its source address; over the maximum it
// answers the refusal itself. It runs before the password check, so a
// source at its maximum costs no bcrypt.
func (c *conn) takeAddrSlot(pk *packets.Packet) bool {
	n := &c.srv.conns
	if !n.take(&n.byAddr, c.host, c.srv.cfg.Limits.MaxConnectionsPerAddress) {
		return c.refuse(pk, packets.ErrQuotaExceeded, 0x03, "max_connections_per_address reached: CONNECT refused")
	}
	c.addrSlot = true
	return true
}

// takeUserSlot counts c under its user (anonymous clients are counted by
// address only); over the maximum it answers the refusal itself, logged
// once a minute per user whatever the address.
func (c *conn) takeUserSlot(pk *packets.Packet) bool {
	if c.user == "" {
		return true
	}
	n := &c.srv.conns
	if !n.take(&n.byUser, c.user, c.srv.cfg.Limits.MaxConnectionsPerUser) {
		return c.refuseKeyed("user\x00"+c.user, pk, packets.ErrQuotaExceeded, 0x03, "max_connections_per_user reached: CONNECT refused", "user", c.user)
	}
	c.userSlot = true
	return true
}

// giveSlots gives back what takeAddrSlot and takeUserSlot took; finish
// calls it once the connection has ended.
func (c *conn) giveSlots() {
	n := &c.srv.conns
	if c.addrSlot {
		n.give(&n.byAddr, c.host)
	}
	if c.userSlot {
		n.give(&n.byUser, c.user)
	}
}
