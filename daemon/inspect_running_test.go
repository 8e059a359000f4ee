package daemon

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/testutil"
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

// An inspect that prints no record says why and exits non-zero, run on a
// stopped data dir or through a running gateway (issue #32: an inspect of
// a master printed nothing and exited 0 while its log held 17,969
// records): --from past the log's end, and a part of the log that holds
// only the gateway's own records without --all.
func TestInspectThatPrintsNothingSaysWhy(t *testing.T) {
	dir := t.TempDir()
	d := testGateway(t, dir, nil)
	pub, _ := v5(t, d.MQTTAddr(), "insp", nil)
	publish(t, pub, &paho.Publish{Topic: "live/a", QoS: 1, Payload: []byte("first")})
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--from", "1000000"}, "the log ends at index"},
		{[]string{"--from", "1", "--limit", "1"}, ""}, // prints a record: exit 0
	} {
		args := append([]string{"inspect", "--data", dir, "--http", d.HTTPAddr()}, tc.args...)
		code, out, errs := runMain(t, args...)
		if tc.want == "" {
			if code != 0 || strings.TrimSpace(out) == "" {
				t.Fatalf("%v: exit %d, %q, %q", tc.args, code, out, errs)
			}
			continue
		}
		if code == 0 || !strings.Contains(errs, tc.want) || strings.TrimSpace(out) != "" {
			t.Fatalf("running gateway, %v: exit %d, stdout %q, stderr %q; want a non-zero exit saying %q", tc.args, code, out, errs, tc.want)
		}
	}
	d.Stop()
	code, out, errs := runMain(t, "inspect", "--data", dir, "--from", "1000000")
	if code == 0 || !strings.Contains(errs, "the log ends at index") || out != "" {
		t.Fatalf("stopped data dir, --from past the end: exit %d, %q, %q", code, out, errs)
	}
	// A gateway no device published to holds only its own records (its
	// feature level's): without --all that is said, with it they print.
	quiet := t.TempDir()
	q := testGateway(t, quiet, nil)
	testutil.WaitFor(t, 10*time.Second, "the feature level record", func() bool {
		code, out, _ := runMain(t, "inspect", "--data", quiet, "--http", q.HTTPAddr(), "--all")
		return code == 0 && out != ""
	})
	q.Stop()
	code, out, errs = runMain(t, "inspect", "--data", quiet)
	if code == 0 || !strings.Contains(errs, "only the gateway's own records (--all shows them)") || out != "" {
		t.Fatalf("a log of the gateway's own records, without --all: exit %d, %q, %q", code, out, errs)
	}
}
