package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/tandem-edge/tandem/discovery"
)

// None of these reaches the network: each fails before any socket opens
// (browsing itself runs in e2e/, inside network namespaces).
func TestPeersCmdUsage(t *testing.T) {
	for _, c := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"peers", "--timeout", "soon"}, ExitUsage, "invalid argument"},
		{[]string{"peers", "--timeout", "0s"}, ExitUsage, "--timeout must be positive"},
		{[]string{"peers", "extra"}, ExitUsage, "unknown command"},
		{[]string{"peers", "--bogus"}, ExitUsage, "unknown flag"},
		{[]string{"peers", "--interface", "no-such-if0", "--timeout", "1ms"}, ExitFailure, "no-such-if0"},
	} {
		var out, errb bytes.Buffer
		if code := Main(c.args, &out, &errb); code != c.code || !strings.Contains(errb.String(), c.msg) {
			t.Errorf("%v: exit %d, stderr %q; want %d and %q", c.args, code, errb.String(), c.code, c.msg)
		}
	}
}

func TestPeersTable(t *testing.T) {
	var b bytes.Buffer
	writePeersTable(&b, nil)
	if b.String() != "no tandem gateways found\n" {
		t.Fatalf("empty: %q", b.String())
	}
	b.Reset()
	writePeersTable(&b, []discovery.Peer{
		{ID: "a1b2c3d4e5f60718", Name: "gw-1", Cluster: "c0ffee", Gen: 2, Role: "master", Term: 7,
			Addrs: []string{"198.51.100.1:7883"}, MQTTPort: 1883, Version: "v1", PairOpen: true},
		{ID: "0000000000000002", Name: "gw-2", Role: "slave", Addrs: []string{}},
	})
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "NAME") ||
		strings.Join(strings.Fields(lines[1]), " ") != "gw-1 a1b2c3d4 c0ffee 2 master 7 198.51.100.1:7883 1883 v1 open" ||
		!strings.Contains(lines[2], "gw-2  ") {
		t.Fatalf("table:\n%s", b.String())
	}
}
