// Package netns builds throwaway multi-host networks for tests: N network
// namespaces ("hosts") plugged into one Linux bridge by veth pairs, with
// addresses from 198.51.100.0/24 (TEST-NET-2) and a multicast route, so mDNS
// and raft traffic really cross a network without touching the machine's own
// namespace.
//
// The bridge lives in a namespace of its own (the "switch"), so nothing is
// added to the host's namespace: no interface there for a host's avahi or
// firewall to see, and interface names only need to be unique per namespace.
// Namespace names carry the pid and a counter, so test packages running in
// parallel never collide. Everything is deleted in t.Cleanup; processes
// started with Host.Start are killed by PID before their namespace goes.
//
// It needs root and iproute2 (`ip`). Call Skip (or Require for more tools)
// first: without them a test skips with a message, except when CI=true,
// where a missing prerequisite fails the test.
package netns

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Subnet is the only range these networks use (RFC 5737 TEST-NET-2).
const (
	Subnet = "198.51.100.0/24"
	prefix = "198.51.100."
)

// Iface is the name of each host's interface on the bridge.
const Iface = "eth0"

// counter makes names unique within one test process; the pid makes them
// unique across the test binaries `go test ./...` runs in parallel.
var counter atomic.Uint64

// Net is one bridge and the hosts on it.
type Net struct {
	t      testing.TB
	id     string // unique per Net: "<pid>-<n>"
	Switch string // name of the namespace holding the bridge
	Hosts  []*Host

	cuts []cut // links cut by Cut, for Heal; used from the test goroutine only
	// losses are the loss rates Loss set, by host pair (lower index
	// first); used from the test goroutine only.
	losses map[[2]*Host]float64
}

// Host is one network namespace with one interface (Iface) on the bridge.
type Host struct {
	net *Net
	// NS is the namespace name (for `ip netns exec`).
	NS string
	// Index is the host's position in Net.Hosts, from 0.
	Index int
	// port is the veth end on the switch side, named in the switch namespace.
	port string

	mu   sync.Mutex // guards addr
	addr string
}

// Skip skips t (or fails it when CI=true) unless this process is root and
// `ip` is on PATH. extra names further commands the test needs (e.g.
// "iptables", "avahi-daemon").
func Skip(t testing.TB, extra ...string) {
	t.Helper()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root")
	}
	for _, c := range append([]string{"ip"}, extra...) {
		if !haveTool(c) {
			missing = append(missing, c)
		}
	}
	if len(missing) == 0 {
		return
	}
	msg := "network-namespace test needs " + strings.Join(missing, ", ")
	if os.Getenv("CI") == "true" {
		t.Fatal(msg + " (CI=true: a missing prerequisite is a failure)")
	}
	t.Skip("SKIPPED: " + msg)
}

// haveTool reports whether command c is on PATH or in an sbin directory:
// a user's PATH on Debian lacks /usr/sbin, where iptables and avahi-daemon
// are, and `ip netns exec` finds them there.
func haveTool(c string) bool {
	if _, err := exec.LookPath(c); err == nil {
		return true
	}
	for _, dir := range []string{"/usr/sbin/", "/sbin/"} {
		if _, err := exec.LookPath(dir + c); err == nil {
			return true
		}
	}
	return false
}

// New builds a bridge with n hosts at 198.51.100.1, .2, … (/24), each with
// loopback up, IPv6 off (so no address outside the test range appears) and
// a route for 224.0.0.0/4 on its interface. It calls Skip itself.
func New(t testing.TB, n int) *Net {
	t.Helper()
	Skip(t)
	if n < 1 || n > 200 {
		t.Fatalf("netns: %d hosts: want 1..200", n)
	}
	nt := &Net{t: t, id: fmt.Sprintf("%d-%d", os.Getpid(), counter.Add(1))}
	nt.Switch = "tandem-" + nt.id + "-sw"
	t.Cleanup(nt.cleanup)
	nt.must("ip", "netns", "add", nt.Switch)
	nt.noIPv6(nt.Switch)
	nt.must("ip", "-n", nt.Switch, "link", "add", "br0", "type", "bridge")
	nt.must("ip", "-n", nt.Switch, "link", "set", "br0", "up")
	for i := 0; i < n; i++ {
		h := &Host{net: nt, NS: fmt.Sprintf("tandem-%s-h%d", nt.id, i+1), Index: i,
			port: fmt.Sprintf("p%d", i+1), addr: fmt.Sprintf("%s%d", prefix, i+1)}
		nt.Hosts = append(nt.Hosts, h)
		nt.must("ip", "netns", "add", h.NS)
		nt.noIPv6(h.NS)
		nt.must("ip", "-n", nt.Switch, "link", "add", h.port, "type", "veth", "peer", "name", Iface, "netns", h.NS)
		nt.must("ip", "-n", nt.Switch, "link", "set", h.port, "master", "br0", "up")
		nt.must("ip", "-n", h.NS, "link", "set", "lo", "up")
		nt.must("ip", "-n", h.NS, "addr", "add", h.addr+"/24", "dev", Iface)
		nt.must("ip", "-n", h.NS, "link", "set", Iface, "up")
		nt.must("ip", "-n", h.NS, "route", "add", "224.0.0.0/4", "dev", Iface)
	}
	return nt
}

// noIPv6 turns IPv6 off in a namespace before its interfaces exist, so they
// get no link-local address (outside the test range, and slow with DAD).
func (nt *Net) noIPv6(ns string) {
	nt.must("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
		"net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
}

func (nt *Net) must(args ...string) {
	nt.t.Helper()
	if out, err := run(args...); err != nil {
		nt.t.Fatalf("netns: %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

func run(args ...string) ([]byte, error) {
	return exec.Command(args[0], args[1:]...).CombinedOutput()
}

// cleanup deletes the namespaces; the veth pairs and the bridge go with
// them. Processes were killed before (their cleanups ran first, LIFO).
func (nt *Net) cleanup() {
	for _, h := range nt.Hosts {
		if out, err := run("ip", "netns", "del", h.NS); err != nil {
			nt.t.Logf("netns: delete %s: %v: %s", h.NS, err, out)
		}
	}
	if out, err := run("ip", "netns", "del", nt.Switch); err != nil {
		nt.t.Logf("netns: delete %s: %v: %s", nt.Switch, err, out)
	}
}

// Addr is the host's current IPv4 address (no prefix length).
func (h *Host) Addr() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.addr
}

// Command is an exec.Cmd that runs name inside the host's namespace
// (`ip netns exec NS name args...`). ip execs name in place, so the
// command's PID is name's own.
func (h *Host) Command(name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", h.NS, name}, args...)...)
}

// Run runs a command in the host's namespace and returns its combined
// output, failing the test on error.
func (h *Host) Run(name string, args ...string) string {
	h.net.t.Helper()
	out, err := h.Command(name, args...).CombinedOutput()
	if err != nil {
		h.net.t.Fatalf("netns %s: %s %s: %v: %s", h.NS, name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// Start starts cmd (usually from Command) and kills it by PID when the test
// ends, before the namespaces are deleted. Stderr and stdout, unless set,
// are collected into the returned Proc.
func (h *Host) Start(cmd *exec.Cmd) *Proc {
	t := h.net.t
	t.Helper()
	p := &Proc{Cmd: cmd, done: make(chan struct{})}
	if cmd.Stdout == nil {
		cmd.Stdout = &p.out
	}
	if cmd.Stderr == nil {
		cmd.Stderr = &p.out
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("netns %s: start %s: %v", h.NS, cmd.Path, err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() { p.Stop() })
	return p
}

// Proc is a process started by Host.Start.
type Proc struct {
	Cmd  *exec.Cmd
	out  syncBuffer
	done chan struct{}
	err  error
}

// Stop kills the process by its PID (SIGKILL) and waits for it. Safe to
// call more than once.
func (p *Proc) Stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.Cmd.Process.Kill()
	<-p.done
}

// Wait waits up to d for the process to exit and returns its error;
// it returns an error if it is still running after d.
func (p *Proc) Wait(d time.Duration) error {
	select {
	case <-p.done:
		return p.err
	case <-time.After(d):
		return errors.New("netns: process still running")
	}
}

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Output is what the process wrote so far to the stdout and stderr that
// Start collected.
func (p *Proc) Output() string { return p.out.String() }

// syncBuffer is a bytes.Buffer safe to read while the process writes.
type syncBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
