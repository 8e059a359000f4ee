package daemon

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/eclipse/paho.golang/paho"
)

// `tandem inspect --data DIR` of a running gateway (the data dir is
// locked) asks the gateway over its API (POST /v1/log, with the token in
// the data dir) and prints the same lines as for a stopped one; without
// the token it says why it cannot.
func TestInspectOfARunningGateway(t *testing.T) {
	dir := t.TempDir()
	d := testGateway(t, dir, nil)
	pub, _ := v5(t, d.MQTTAddr(), "insp", nil)
	publish(t, pub, &paho.Publish{Topic: "live/a", QoS: 1, Payload: []byte("first")})
	publish(t, pub, &paho.Publish{Topic: "live/b", QoS: 1, Payload: []byte("second")})

	code, out, errs := runMain(t, "inspect", "--data", dir, "--http", d.HTTPAddr(), "--payload", "text")
	if code != 0 {
		t.Fatalf("inspect of a running gateway: exit %d: %s", code, errs)
	}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var r inspectLine
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		if strings.HasPrefix(r.Topic, "live/") {
			got = append(got, r.Topic+"="+r.Payload)
		}
	}
	if strings.Join(got, ",") != "live/a=first,live/b=second" {
		t.Fatalf("inspect printed %v", got)
	}
	code, _, errs = runMain(t, "inspect", "--data", dir, "--http", d.HTTPAddr(), "--token-file", "/nonexistent/token", "--limit", "1")
	if code == 0 || !strings.Contains(errs, "running gateway") {
		t.Fatalf("inspect without the token: exit %d, %q; want an error naming the running gateway", code, errs)
	}
}
