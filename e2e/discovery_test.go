package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/discovery"
	"github.com/tandem-edge/tandem/internal/netns"
)

// advertiser is a discovery.Advertise helper process in a namespace.
type advertiser struct {
	stdin io.WriteCloser
	lines chan string
	proc  *netns.Proc
}

// startAdvertiser runs the "advertise" helper on h with info and waits
// for it to be ready; it returns the backend it chose.
func startAdvertiser(t *testing.T, h *netns.Host, info discovery.Info, env ...string) (*advertiser, string) {
	t.Helper()
	b, _ := json.Marshal(info)
	cmd := h.Command(testBinary(t))
	cmd.Env = append(append(os.Environ(), "TANDEM_E2E_HELPER=advertise", "TANDEM_E2E_INFO="+string(b),
		"TANDEM_E2E_IFACE="+netns.Iface), env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	a := &advertiser{stdin: stdin, lines: make(chan string, 16)}
	a.proc = h.Start(cmd)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			a.lines <- sc.Text()
		}
		close(a.lines)
	}()
	ready := a.expect(t, "ready ")
	return a, strings.TrimPrefix(ready, "ready ")
}

// expect waits up to 10 s for a line starting with prefix.
func (a *advertiser) expect(t *testing.T, prefix string) string {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case l, ok := <-a.lines:
			if !ok {
				t.Fatalf("advertiser exited before %q: %s", prefix, a.proc.Output())
			}
			if strings.HasPrefix(l, "error") {
				t.Fatalf("advertiser: %s", l)
			}
			if strings.HasPrefix(l, prefix) {
				return l
			}
		case <-deadline:
			t.Fatalf("advertiser: no %q within 10s", prefix)
		}
	}
}

// set replaces the advertiser's Info and calls Changed.
func (a *advertiser) set(t *testing.T, info discovery.Info) {
	t.Helper()
	b, _ := json.Marshal(info)
	if _, err := fmt.Fprintf(a.stdin, "%s\n", b); err != nil {
		t.Fatal(err)
	}
	a.expect(t, "changed")
}

// close closes the advertiser cleanly (avahi: goodbye) and waits for it.
func (a *advertiser) close(t *testing.T) {
	t.Helper()
	a.stdin.Close()
	if err := a.proc.Wait(10 * time.Second); err != nil {
		t.Fatalf("advertiser close: %v: %s", err, a.proc.Output())
	}
}

// contractKeys are the keys of one `tandem peers --json` element (DESIGN.md).
var contractKeys = []string{"addrs", "cluster", "gen", "id", "mqtt_port", "name", "role", "term", "version"}

// runPeers runs `tandem peers --json` on h once and checks the JSON shape.
func runPeers(t *testing.T, h *netns.Host, timeout string, env ...string) []discovery.Peer {
	t.Helper()
	cmd := h.Command(tandemBin(t), "peers", "--json", "--timeout", timeout, "--interface", netns.Iface)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tandem peers: %v: %s", err, out)
	}
	var raw []map[string]any
	if err := json.Unmarshal(out, &raw); err != nil {
		t.Fatalf("tandem peers --json: %v: %s", err, out)
	}
	for _, m := range raw {
		var keys []string
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		if !reflect.DeepEqual(keys, contractKeys) {
			t.Fatalf("peers JSON keys %v, want %v", keys, contractKeys)
		}
	}
	var peers []discovery.Peer
	if err := json.Unmarshal(out, &peers); err != nil {
		t.Fatal(err)
	}
	return peers
}

// waitPeers runs `tandem peers --timeout 1s` on h until ok accepts the list
// or within expires; it returns the list and how long it took.
func waitPeers(t *testing.T, h *netns.Host, within time.Duration, ok func([]discovery.Peer) bool, env ...string) ([]discovery.Peer, time.Duration) {
	t.Helper()
	start := time.Now()
	var last []discovery.Peer
	for time.Since(start) < within {
		if last = runPeers(t, h, "1s", env...); ok(last) {
			return last, time.Since(start)
		}
	}
	t.Fatalf("tandem peers on %s: not as expected within %v; last: %+v", h, within, last)
	return nil, 0
}

// byID finds the peer with id.
func byID(peers []discovery.Peer, id string) (discovery.Peer, bool) {
	for _, p := range peers {
		if p.ID == id {
			return p, true
		}
	}
	return discovery.Peer{}, false
}

// has reports whether every info is listed with its values and addrs.
func has(peers []discovery.Peer, want map[string]discovery.Peer) bool {
	for id, w := range want {
		p, ok := byID(peers, id)
		if !ok || !reflect.DeepEqual(p, w) {
			return false
		}
	}
	return true
}

// expectPeer is the Peer that `tandem peers --json` should list for info
// at addr (the contract's JSON has no pairing flag).
func expectPeer(info discovery.Info, addr string) discovery.Peer {
	return discovery.Peer{ID: info.ID, Name: info.Name, Cluster: info.Cluster, Gen: info.Gen, Role: info.Role,
		Term: info.Term, Addrs: []string{fmt.Sprintf("%s:%d", addr, info.PeerPort)}, MQTTPort: info.MQTTPort,
		Version: info.Version}
}

func infoFor(n int) discovery.Info {
	return discovery.Info{ID: fmt.Sprintf("%016x", 0xa1b2c3d400000000+uint64(n)), Name: fmt.Sprintf("gw-%d", n),
		Cluster: "c0ffee", Role: "slave", Version: "v-test", Gen: 1, Term: uint64(3 + n), PeerPort: 7883, MQTTPort: 1883}
}

// TestPeersOverMDNS: two gateways advertising with hashicorp/mdns, `tandem
// peers` on a third host lists both with their TXT values within 5 s,
// follows live changes (term, role, pairing) and an address change, and
// stops listing one that is gone.
func TestPeersOverMDNS(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	h1, h2, h3 := nt.Hosts[0], nt.Hosts[1], nt.Hosts[2]
	tandemBin(t) // build before the clock starts
	i1, i2 := infoFor(1), infoFor(2)
	i2.Cluster, i2.PairOpen = "", true
	a1, b1 := startAdvertiser(t, h1, i1)
	_, b2 := startAdvertiser(t, h2, i2)
	if b1 != discovery.BackendMDNS || b2 != discovery.BackendMDNS {
		t.Fatalf("backends %s %s, want mdns (no avahi in these namespaces)", b1, b2)
	}
	want := map[string]discovery.Peer{i1.ID: expectPeer(i1, h1.Addr()), i2.ID: expectPeer(i2, h2.Addr())}
	_, took := waitPeers(t, h3, 5*time.Second, func(p []discovery.Peer) bool { return has(p, want) })
	t.Logf("tandem peers listed both in %v (--timeout 1s)", took.Round(time.Millisecond))

	// Live values: answers are built from Info at each query.
	i1.Role, i1.Term, i1.Gen, i1.PairOpen = "master", 9, 2, true
	a1.set(t, i1)
	want[i1.ID] = expectPeer(i1, h1.Addr())
	waitPeers(t, h3, 5*time.Second, func(p []discovery.Peer) bool { return has(p, want) })

	// An address change (DHCP) shows in the next browse.
	h1.SetAddr("101")
	want[i1.ID] = expectPeer(i1, "198.51.100.101")
	waitPeers(t, h3, 5*time.Second, func(p []discovery.Peer) bool { return has(p, want) })

	// Gone: no longer listed (hashicorp/mdns has no goodbye; a browse
	// simply gets no answer).
	a1.close(t)
	waitPeers(t, h3, 5*time.Second, func(p []discovery.Peer) bool {
		_, ok := byID(p, i1.ID)
		return !ok && has(p, map[string]discovery.Peer{i2.ID: want[i2.ID]})
	})
}

// TestAvahi: on a host running avahi-daemon (private D-Bus), the
// advertiser goes through avahi, avahi-browse resolves both our services
// (and those of a gateway on the hashicorp/mdns path), `tandem peers`
// elsewhere finds the avahi-published gateway with current TXT values, and
// `tandem peers` beside avahi (browsing through it) finds both.
func TestAvahi(t *testing.T) {
	t.Parallel()
	netns.Skip(t, "avahi-daemon", "avahi-browse", "dbus-daemon", "unshare")
	nt := netns.New(t, 2)
	h1, h2 := nt.Hosts[0], nt.Hosts[1]
	tandemBin(t)
	bus, restartAvahi := startAvahi(t, h1)
	env := []string{"DBUS_SYSTEM_BUS_ADDRESS=" + bus}

	i1, i2 := infoFor(1), infoFor(2)
	a1, b1 := startAdvertiser(t, h1, i1, env...)
	if b1 != discovery.BackendAvahi {
		t.Fatalf("advertiser beside avahi-daemon used %q, want avahi", b1)
	}
	_, b2 := startAdvertiser(t, h2, i2)
	if b2 != discovery.BackendMDNS {
		t.Fatalf("advertiser without avahi used %q", b2)
	}

	// A standard tool sees us: avahi-browse resolves both services of the
	// avahi-published gateway and the peers service of the other one.
	want := []string{
		"_tandem._tcp;local;gw-1;198.51.100.1;7883;" + i1.ID,
		"_mqtt._tcp;local;gw-1;198.51.100.1;1883;",
		"_tandem._tcp;local;gw-2;198.51.100.2;7883;" + i2.ID,
		"_mqtt._tcp;local;gw-2;198.51.100.2;1883;",
	}
	deadline := time.Now().Add(15 * time.Second)
	var got []string
	for {
		got = avahiBrowse(t, h1, env, "_tandem._tcp")
		got = append(got, avahiBrowse(t, h1, env, "_mqtt._tcp")...)
		if containsAll(got, want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("avahi-browse: want %q among %q", want, got)
		}
	}

	// From the other host (hashicorp/mdns browse, answered by avahi).
	wantPeers := map[string]discovery.Peer{i1.ID: expectPeer(i1, h1.Addr()), i2.ID: expectPeer(i2, h2.Addr())}
	_, took := waitPeers(t, h2, 5*time.Second, func(p []discovery.Peer) bool { return has(p, wantPeers) })
	t.Logf("tandem peers (no avahi) listed both in %v", took.Round(time.Millisecond))
	// Beside avahi (browse through avahi over D-Bus).
	_, took = waitPeers(t, h1, 5*time.Second, func(p []discovery.Peer) bool { return has(p, wantPeers) }, env...)
	t.Logf("tandem peers (through avahi) listed both in %v", took.Round(time.Millisecond))

	// Changed goes out through avahi (UpdateServiceTxt).
	i1.Role, i1.Term, i1.PairOpen = "master", 12, true
	a1.set(t, i1)
	wantPeers[i1.ID] = expectPeer(i1, h1.Addr())
	waitPeers(t, h2, 5*time.Second, func(p []discovery.Peer) bool { return has(p, wantPeers) })

	// avahi-daemon restarts (killed, started again): the advertiser
	// registers with the new one.
	restartAvahi()
	waitPeers(t, h2, 10*time.Second, func(p []discovery.Peer) bool { return has(p, wantPeers) })

	// A clean stop withdraws the services from avahi (goodbye).
	a1.close(t)
	waitPeers(t, h2, 5*time.Second, func(p []discovery.Peer) bool {
		_, ok := byID(p, i1.ID)
		return !ok
	})
}

// startAvahi starts a private system bus and avahi-daemon on h (both
// killed by PID at the end) and returns the bus address once avahi owns
// org.freedesktop.Avahi on it, and a func that kills avahi-daemon and
// starts it again.
func startAvahi(t *testing.T, h *netns.Host) (string, func()) {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "bus.sock")
	busConf := fmt.Sprintf(`<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path=%s</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_type="method_return"/>
    <allow send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="signal"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
  </policy>
</busconfig>
`, sock)
	avahiConf := fmt.Sprintf(`[server]
host-name=tandem-avahi-%d
use-ipv4=yes
use-ipv6=no
allow-interfaces=%s
enable-dbus=yes
ratelimit-interval-usec=1000000
ratelimit-burst=1000
[wide-area]
enable-wide-area=no
[publish]
publish-hinfo=no
publish-workstation=no
`, os.Getpid(), netns.Iface)
	for name, body := range map[string]string{"bus.conf": busConf, "avahi.conf": avahiConf} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bus := h.Start(h.Command("dbus-daemon", "--nofork", "--nopidfile", "--print-address", "--config-file="+filepath.Join(dir, "bus.conf")))
	// It prints its address once it listens.
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(bus.Output(), sock); {
		if time.Now().After(deadline) {
			t.Fatalf("dbus-daemon not listening within 10s: %s", bus.Output())
		}
		time.Sleep(20 * time.Millisecond) // poll interval, not synchronisation
	}
	addr := "unix:path=" + sock
	var procs []*netns.Proc // avahi-daemons started, the running one last
	// avahi-daemon keeps its pid file and socket in /run/avahi-daemon and
	// refuses to start when the pid file names a live process: give it a
	// private one (a mount namespace of its own, tmpfs there), so it runs
	// beside the machine's avahi and beside other tests'.
	if err := os.MkdirAll("/run/avahi-daemon", 0o755); err != nil {
		t.Fatal(err)
	}
	start := func() {
		t.Helper()
		cmd := h.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
			`mount -t tmpfs tmpfs /run/avahi-daemon && exec avahi-daemon --no-drop-root --no-chroot --no-rlimits -f "$1"`,
			"sh", filepath.Join(dir, "avahi.conf"))
		cmd.Env = append(os.Environ(), "DBUS_SYSTEM_BUS_ADDRESS="+addr)
		avahi := h.Start(cmd)
		deadline := time.Now().Add(10 * time.Second)
		for {
			out, err := h.Command("dbus-send", "--bus="+addr, "--print-reply", "--dest=org.freedesktop.DBus",
				"/org/freedesktop/DBus", "org.freedesktop.DBus.NameHasOwner", "string:org.freedesktop.Avahi").CombinedOutput()
			if err == nil && strings.Contains(string(out), "boolean true") {
				procs = append(procs, avahi)
				return
			}
			select {
			case <-avahi.Done():
				t.Fatalf("avahi-daemon exited: %s", avahi.Output())
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("avahi-daemon did not own org.freedesktop.Avahi within 10s: %s %v; avahi: %s", out, err, avahi.Output())
			}
			time.Sleep(50 * time.Millisecond) // poll interval, not synchronisation
		}
	}
	start()
	return addr, func() {
		t.Helper()
		procs[len(procs)-1].Stop()
		start()
	}
}

// avahiBrowse runs `avahi-browse -rpt SERVICE` on h and returns its
// resolved lines as "type;domain;name;address;port;TXT id".
func avahiBrowse(t *testing.T, h *netns.Host, env []string, service string) []string {
	t.Helper()
	cmd := h.Command("avahi-browse", "-rpt", service)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("avahi-browse: %v: %s", err, out)
	}
	var lines []string
	for _, l := range strings.Split(string(out), "\n") {
		// =;eth0;IPv4;gw-1;_tandem._tcp;local;host.local;198.51.100.1;7883;"ver=..." "id=..."
		f := strings.SplitN(l, ";", 10)
		if len(f) < 10 || f[0] != "=" {
			continue
		}
		id := ""
		for _, kv := range strings.Fields(f[9]) {
			if v, ok := strings.CutPrefix(strings.Trim(kv, `"`), "id="); ok && service == discovery.ServicePeers {
				id = v
			}
		}
		lines = append(lines, strings.Join([]string{f[4], f[5], f[3], f[7], f[8], id}, ";"))
	}
	return lines
}

func containsAll(got, want []string) bool {
	for _, w := range want {
		found := false
		for _, g := range got {
			if g == w {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}
