package daemon

import (
	"strings"
	"testing"

	"github.com/tandem-edge/tandem/cluster"
)

// A second gateway started on one machine finds the first one's ports
// taken: the error names the flag that gives it its own.
func TestSecondGatewayOnTakenPortsNamesTheFlag(t *testing.T) {
	first := testGateway(t, t.TempDir(), nil)
	for _, tc := range []struct{ flag, want string }{
		{"--peer", first.PeerAddr()},
		{"--mqtt", first.MQTTAddr()},
		{"--http", first.HTTPAddr()},
	} {
		args := map[string]string{"--peer": "127.0.0.1:0", "--mqtt": "127.0.0.1:0", "--http": "127.0.0.1:0"}
		args[tc.flag] = tc.want
		code, _, stderr := runMain(t, "run", "--data", t.TempDir(), "--peer", args["--peer"], "--mqtt", args["--mqtt"], "--http", args["--http"])
		if code == 0 || !strings.Contains(stderr, "already in use") || !strings.Contains(stderr, "give this one its own with "+tc.flag+" ") {
			t.Errorf("%s taken: exit %d, stderr %q; want the flag named", tc.flag, code, stderr)
		}
	}
}

// The embedded default keeps the peer port on loopback: a join token made
// there names only 127.0.0.1, so invite says how to open the port
// instead, unless --loopback asks for the token anyway.
func TestInviteOnLoopbackPeerPortSaysHowToOpenIt(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil) // peer on 127.0.0.1
	code, out, stderr := runMain(t, "cluster", "invite", "--http", d.HTTPAddr(), "--data", d.cfg.Node.DataDir)
	if code != ExitFailure || out != "" || !strings.Contains(stderr, "peer.listen") || !strings.Contains(stderr, "--peer :7883") || !strings.Contains(stderr, "--loopback") {
		t.Fatalf("invite on loopback: exit %d, stdout %q, stderr %q", code, out, stderr)
	}
	code, out, stderr = runMain(t, "cluster", "invite", "--loopback", "--http", d.HTTPAddr(), "--data", d.cfg.Node.DataDir)
	if code != 0 || !strings.HasPrefix(out, cluster.TokenPrefix) {
		t.Fatalf("invite --loopback: exit %d, stdout %q, stderr %q", code, out, stderr)
	}
	for _, tc := range []struct {
		addrs []string
		want  bool
	}{
		{[]string{"127.0.0.1:7883"}, true},
		{[]string{"[::1]:7883", "localhost:7883"}, true},
		{[]string{"127.0.0.1:7883", "192.0.2.1:7883"}, false},
		{[]string{"gw-1.local:7883"}, false},
		{nil, false},
	} {
		if got := LoopbackOnly(tc.addrs); got != tc.want {
			t.Errorf("LoopbackOnly(%v) = %v", tc.addrs, got)
		}
	}
}
