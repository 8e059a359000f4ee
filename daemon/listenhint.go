package daemon

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"syscall"
)

// Hints for the two places a new user meets the listeners' defaults: a
// second gateway started on one machine, whose ports the first one holds,
// and a join token made on a gateway whose peer port only its own machine
// can reach.

// inUse words a listener's "address already in use" so that it names the
// flag and config key giving this gateway a port of its own. Any other
// error is returned as it is.
func inUse(err error, what, addr, flag, key string) error {
	if !errors.Is(err, syscall.EADDRINUSE) {
		return err
	}
	return fmt.Errorf("%s %s is already in use (another gateway on this machine?): give this one its own with %s %s "+
		"or %s in its config; a second gateway on one machine needs its own --mqtt, --http and --peer, and its own --data: %w",
		what, addr, flag, nextPort(addr), key, err)
}

// nextPort suggests the address one port up from addr (":7883" →
// ":7884"), or "HOST:PORT" when addr does not parse.
func nextPort(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	p, perr := strconv.Atoi(port)
	if err != nil || perr != nil || p <= 0 || p >= 65535 {
		return "HOST:PORT"
	}
	return net.JoinHostPort(host, strconv.Itoa(p+1))
}

// LoopbackOnly reports whether every address a join token carries is on
// loopback: only a gateway on this same machine could use it.
func LoopbackOnly(addrs []string) bool {
	for _, a := range addrs {
		host, _, err := net.SplitHostPort(a)
		if err != nil {
			return false
		}
		if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
			return false
		}
	}
	return len(addrs) > 0
}

// LoopbackPeerError is what `tandem cluster invite` says instead of printing
// a token that names only loopback addresses.
func LoopbackPeerError(addrs []string) error {
	return fmt.Errorf("the peer port listens on loopback only (%v), so a gateway on another machine cannot use a join token: "+
		"open it to the LAN with `peer.listen: \":7883\"` in the config (the packaged /etc/tandem/tandem.yaml does) or `tandem run --peer :7883`, "+
		"restart, and invite again; for a second gateway on this same machine, add --loopback", addrs)
}
