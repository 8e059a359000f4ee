// Package testutil holds the helpers the module's tests share, so that no
// test file keeps its own copy: finding a tool the test needs, a free
// port, polling with a deadline, a log buffer goroutines may share, and the
// framing of a raw MQTT client (mqtt.go). It
// imports no package of ours, so that any package's internal tests may use
// it. It starts no goroutines but a Relay's (relay.go), which end with
// the test.
package testutil

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// NeedTool returns the path of the program name, or skips the test when it
// is not installed. Under CI=true a missing tool fails the test instead:
// .ci/run installs every tool the tests use, so a skip there would hide a
// broken setup.
func NeedTool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s not found: .ci/run should have installed it", name)
		}
		t.Skipf("%s not found", name)
	}
	return p
}

// FreeAddr returns a loopback address whose port was free a moment ago:
// for a listener a test starts itself, or one nobody should answer on.
func FreeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("picking a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// FreeAddrs is n FreeAddr that differ from each other: each port is held
// until all are picked (two FreeAddr in a row may give the same port, the
// first being free again once closed).
func FreeAddrs(t testing.TB, n int) []string {
	t.Helper()
	out := make([]string, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("picking a free port: %v", err)
		}
		defer ln.Close()
		out = append(out, ln.Addr().String())
	}
	return out
}

// FreePort is FreeAddr's port, for configs that take the port alone.
func FreePort(t testing.TB) int {
	t.Helper()
	_, port, _ := net.SplitHostPort(FreeAddr(t))
	p, err := strconv.Atoi(port)
	if err != nil {
		t.Fatalf("picking a free port: %v", err)
	}
	return p
}

// WaitFor polls cond until it holds, and fails the test when it still does
// not after d: the way tests wait, instead of sleeping. diag, if given,
// says what was seen instead, in the failure.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool, diag ...func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	// Polling, not synchronisation: from 1 ms, so that what is nearly
	// there costs no wait, up to 10 ms, so that a long wait on a costly
	// cond (an HTTP call) leaves the CPU to what it waits for.
	pause := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			var seen string
			for _, f := range diag {
				seen += "; " + f()
			}
			t.Fatalf("timed out after %v waiting for %s%s", d, what, seen)
		}
		time.Sleep(pause)
		pause = min(2*pause, 10*time.Millisecond)
	}
}

// CollectUntil reads ch until an item that name calls last arrives, and
// returns the names of what arrived, in order; it fails the test when last
// has not come within d. Tests use it on received publishes, by payload.
func CollectUntil[T any](t testing.TB, ch <-chan T, name func(T) string, last string, d time.Duration) []string {
	t.Helper()
	var got []string
	deadline := time.After(d)
	for {
		select {
		case it := <-ch:
			got = append(got, name(it))
			if got[len(got)-1] == last {
				return got
			}
		case <-deadline:
			t.Fatalf("no %q within %v; got %q", last, d, got)
			return got
		}
	}
}

// Buffer is an io.Writer that goroutines may share: a gateway's log, a
// child process's output.
type Buffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

// Write appends p.
func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Count returns how many times s was written (in log lines: how many lines
// contain it, when it cannot span two).
func (l *Buffer) Count(s string) int { return strings.Count(l.String(), s) }

// Tail returns the last n bytes written, marked when cut.
func (l *Buffer) Tail(n int) string {
	s := l.String()
	if len(s) > n {
		s = "…" + s[len(s)-n:]
	}
	return s
}
