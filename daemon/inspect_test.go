package daemon

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/eclipse/paho.golang/paho"
)

// --payload prints payloads as base64 (the default, DESIGN.md), text or
// hex; text never garbles a payload that is not UTF-8.
func TestInspectPayloadEncodings(t *testing.T) {
	dir := t.TempDir()
	d := testGateway(t, dir, nil)
	c, _ := v5(t, d.MQTTAddr(), "inspect-payload", nil)
	publish(t, c, &paho.Publish{Topic: "t/text", QoS: 1, Payload: []byte("héllo")})
	publish(t, c, &paho.Publish{Topic: "t/bin", QoS: 1, Payload: []byte{0xff, 0x00, 0x01}})
	_ = c.Disconnect(&paho.Disconnect{})
	d.Stop()

	lines := func(args ...string) []inspectLine {
		t.Helper()
		code, out, stderr := runMain(t, append([]string{"inspect", "--data", dir}, args...)...)
		if code != 0 {
			t.Fatalf("inspect %v: exit %d: %s", args, code, stderr)
		}
		var recs []inspectLine
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			var r inspectLine
			if err := json.Unmarshal([]byte(l), &r); err != nil {
				t.Fatalf("inspect %v printed %q: %v", args, l, err)
			}
			recs = append(recs, r)
		}
		if len(recs) != 2 {
			t.Fatalf("inspect %v: %d records, want 2", args, len(recs))
		}
		return recs
	}
	for _, tc := range []struct {
		args                 []string
		text, bin, binMarked string
	}{
		{nil, "aMOpbGxv", "/wAB", ""},
		{[]string{"--payload", "base64"}, "aMOpbGxv", "/wAB", ""},
		{[]string{"--payload", "hex"}, "68c3a96c6c6f", "ff0001", ""},
		{[]string{"--payload", "text"}, "héllo", "/wAB", "base64"},
	} {
		r := lines(tc.args...)
		if r[0].Payload != tc.text || r[0].PayloadEncoding != "" || r[1].Payload != tc.bin || r[1].PayloadEncoding != tc.binMarked {
			t.Errorf("inspect %v: %+v / %+v", tc.args, r[0], r[1])
		}
	}
	if code, _, stderr := runMain(t, "inspect", "--data", dir, "--payload", "utf16"); code != ExitUsage || !strings.Contains(stderr, "base64, text or hex") {
		t.Errorf("--payload utf16: exit %d %s", code, stderr)
	}
}

// inspect of a running gateway whose API it cannot reach says that the
// data dir is in use and where it looked for the gateway.
func TestInspectOfARunningGatewayItCannotReachSaysSo(t *testing.T) {
	dir := t.TempDir()
	testGateway(t, dir, nil) // its API on a port inspect is not told
	code, _, stderr := runMain(t, "inspect", "--data", dir, "--http", "127.0.0.1:1")
	if code == 0 || !strings.Contains(stderr, "in use by a running gateway") || !strings.Contains(stderr, "--http") {
		t.Fatalf("inspect of a running gateway it cannot reach: exit %d, %s", code, stderr)
	}
}
