package netns

import (
	"fmt"
	"os/exec"
	"strings"
)

// Faults a failover test needs: links cut between two hosts (iptables DROP
// rules inside each namespace; the kernel here has no netem), a host taken
// off the bridge, and an address change as DHCP would make one.

// cut is one pair of hosts cut apart, with the addresses the rules name.
type cut struct {
	a, b         *Host
	aAddr, bAddr string
}

// Cut drops all IPv4 traffic between a and b in both directions (unicast
// and multicast: the rules match the source address), until Heal. The
// rules name the addresses the hosts have now. Cutting a pair twice is a
// no-op.
func (nt *Net) Cut(a, b *Host) {
	nt.t.Helper()
	if nt.cutIndex(a, b) >= 0 {
		return
	}
	c := cut{a: a, b: b, aAddr: a.Addr(), bAddr: b.Addr()}
	nt.rules("-I", c)
	nt.cuts = append(nt.cuts, c)
}

// Heal removes the rules a Cut of a and b added. Healing an uncut pair is a
// no-op.
func (nt *Net) Heal(a, b *Host) {
	nt.t.Helper()
	i := nt.cutIndex(a, b)
	if i < 0 {
		return
	}
	nt.rules("-D", nt.cuts[i])
	nt.cuts = append(nt.cuts[:i], nt.cuts[i+1:]...)
}

// Partition cuts every host of each group from every host of the other
// groups; HealAll undoes it. For example Partition([]*Host{h1}, []*Host{h2, h3})
// isolates h1.
func (nt *Net) Partition(groups ...[]*Host) {
	nt.t.Helper()
	for i, g := range groups {
		for _, o := range groups[i+1:] {
			for _, a := range g {
				for _, b := range o {
					nt.Cut(a, b)
				}
			}
		}
	}
}

// HealAll removes every cut.
func (nt *Net) HealAll() {
	nt.t.Helper()
	for len(nt.cuts) > 0 {
		c := nt.cuts[0]
		nt.Heal(c.a, c.b)
	}
}

func (nt *Net) cutIndex(a, b *Host) int {
	for i, c := range nt.cuts {
		if (c.a == a && c.b == b) || (c.a == b && c.b == a) {
			return i
		}
	}
	return -1
}

func (nt *Net) rules(op string, c cut) {
	nt.t.Helper()
	for _, r := range [][3]string{{c.a.NS, c.bAddr}, {c.b.NS, c.aAddr}} {
		nt.must("ip", "netns", "exec", r[0], "iptables", "-w", op, "INPUT", "-s", r[1], "-j", "DROP")
		nt.must("ip", "netns", "exec", r[0], "iptables", "-w", op, "OUTPUT", "-d", r[1], "-j", "DROP")
	}
}

// Unplug takes the host's cable out: its port on the bridge goes down, so
// it reaches nobody and nobody reaches it. Its own interface and address
// stay as they are.
func (h *Host) Unplug() {
	h.net.t.Helper()
	h.net.must("ip", "-n", h.net.Switch, "link", "set", h.port, "down")
}

// Plug undoes Unplug.
func (h *Host) Plug() {
	h.net.t.Helper()
	h.net.must("ip", "-n", h.net.Switch, "link", "set", h.port, "up")
}

// SetAddr moves the host to another address of 198.51.100.0/24, as a DHCP
// renewal would: the old address is removed, the new one added. host is
// the last byte (1..254) or a full address in the test range.
func (h *Host) SetAddr(host string) {
	h.net.t.Helper()
	addr := host
	if !strings.Contains(addr, ".") {
		addr = prefix + host
	}
	if !strings.HasPrefix(addr, prefix) {
		h.net.t.Fatalf("netns: %s is outside %s", addr, Subnet)
	}
	old := h.Addr()
	// Delete first: with the new address added first it would be a
	// secondary, which the kernel deletes along with the primary.
	h.net.must("ip", "-n", h.NS, "addr", "del", old+"/24", "dev", Iface)
	h.net.must("ip", "-n", h.NS, "addr", "add", addr+"/24", "dev", Iface)
	// Removing the last address flushed the device's routes.
	h.net.must("ip", "-n", h.NS, "route", "replace", "224.0.0.0/4", "dev", Iface)
	h.mu.Lock()
	h.addr = addr
	h.mu.Unlock()
}

// AddAddrs gives the host n more addresses of 198.51.100.0/24, the last
// bytes first to first+n-1, beside its own, and returns them: sources of
// their own for a test that needs many (a flood from many addresses, as
// an attacker with a subnet has). They go with the namespace.
func (h *Host) AddAddrs(first, n int) []string {
	h.net.t.Helper()
	if first < 2 || first+n > 255 {
		h.net.t.Fatalf("netns: addresses %d..%d: want 2..254", first, first+n-1)
	}
	var out []string
	var batch strings.Builder
	for i := range n {
		a := fmt.Sprintf("%s%d", prefix, first+i)
		fmt.Fprintf(&batch, "addr add %s/24 dev %s\n", a, Iface)
		out = append(out, a)
	}
	// One ip process for all: forty of them take seconds on a busy host.
	cmd := exec.Command("ip", "-n", h.NS, "-batch", "-")
	cmd.Stdin = strings.NewReader(batch.String())
	if b, err := cmd.CombinedOutput(); err != nil {
		h.net.t.Fatalf("netns: adding %d addresses to %s: %v: %s", n, h.NS, err, b)
	}
	return out
}

// String names the host for test logs.
func (h *Host) String() string { return fmt.Sprintf("%s(%s)", h.NS, h.Addr()) }
