package daemon

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/tandem-edge/tandem/bench"
)

func TestBenchAgainstAGateway(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	for _, v := range []string{"3", "5"} {
		code, out, stderr := runMain(t, "bench", "--broker", d.MQTTAddr(), "--clients", "3", "--count", "200",
			"--window", "8", "--qos", "1", "--mqtt-version", v, "--subscribe", "--json")
		if code != 0 {
			t.Fatalf("bench (MQTT %s): exit %d: %s", v, code, stderr)
		}
		var r bench.Result
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatalf("bench --json printed %q: %v", out, err)
		}
		if r.Acked != 600 || r.Failed != 0 || r.Received != 600 || r.MsgPerSec <= 0 || r.AckP50Ms <= 0 || r.AckP99Ms < r.AckP50Ms {
			t.Fatalf("MQTT %s: %+v", v, r)
		}
	}
	// The log holds what was acked: 2 runs × 3 clients × 200.
	if n := len(logRecords(t, d)); n != 1200 {
		t.Fatalf("log holds %d records, want 1200", n)
	}
	code, out, _ := runMain(t, "bench", "--broker", d.MQTTAddr(), "--count", "10")
	if code != 0 || !strings.Contains(out, "throughput") || !strings.Contains(out, "p99") {
		t.Fatalf("human output: %d %q", code, out)
	}
	if code, _, _ := runMain(t, "bench", "--qos", "3"); code != ExitUsage {
		t.Fatalf("--qos 3: exit %d, want 2", code)
	}
}
