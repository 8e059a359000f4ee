package daemon_test

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// rssKB reads a process's resident set from /proc.
func rssKB(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// Strangers cannot make the gateway allocate before they log in: 300
// connections from 3 addresses that announce a big CONNECT and stall —
// half claiming 1 MB (over the 64 KiB a packet may have before login:
// closed at once), half claiming 60 KiB and sending a little of it (held
// by a budget shared by every such connection) — leave the daemon's RSS
// under 60 MB, and it still serves.
func TestPreAuthMemoryIsBounded(t *testing.T) {
	p := startTandem(t, t.TempDir(), nil)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < 300; i++ {
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(fmt.Sprintf("127.0.0.%d", 2+i%3))}}
		c, err := d.Dial("tcp", p.addrs.mqtt)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		conns = append(conns, c)
		if i%2 == 0 {
			c.Write([]byte{0x10, 0xc0, 0x84, 0x3d}) // remaining length 1,000,000
		} else {
			c.Write(append([]byte{0x10, 0xe0, 0xd4, 0x03}, make([]byte, 100)...)) // 60,000, 100 bytes of it
		}
	}
	before := rssKB(t, p.cmd.Process.Pid)
	// Watch the resident set for a while: the claims are read by now or
	// within it (a bounded observation, not a synchronisation).
	peak := before
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		peak = max(peak, rssKB(t, p.cmd.Process.Pid))
	}
	if peak > 60*1024 {
		t.Fatalf("RSS reached %d KB with 300 stalled pre-login connections, want under 60 MB", peak)
	}
	t.Logf("RSS %d KB peak with 300 stalled pre-login connections", peak)
	c, err := net.DialTimeout("tcp", p.addrs.mqtt, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write([]byte{0x10, 12, 0, 4, 'M', 'Q', 'T', 'T', 4, 2, 0, 30, 0, 0})
	var ack [4]byte
	if _, err := c.Read(ack[:]); err != nil || ack[0] != 0x20 || ack[3] != 0 {
		t.Fatalf("a real client after the stalls: %x %v", ack, err)
	}
	if code := p.stop(5 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
}
