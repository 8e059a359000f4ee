package daemon

import (
	"context"
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

// An MQTT 3.1.1 client has no receive maximum to respect: one that keeps
// more publishes in flight than max_inflight is slowed down, not dropped.
func TestMQTT311ClientOverReceiveMaximumIsSlowedNotDropped(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *Config) { c.MQTT.MaxInflight = 4 })
	res, err := bench.Run(context.Background(), bench.Options{Broker: d.MQTTAddr(), Clients: 2, Count: 300, Window: 32, QoS: 1, Size: 16, Version: 3})
	if err != nil {
		t.Fatal(err)
	}
	if res.Acked != 600 || res.Failed != 0 {
		t.Fatalf("acked %d of 600, %d failed (%s)", res.Acked, res.Failed, res.FirstFailure)
	}
	res, err = bench.Run(context.Background(), bench.Options{Broker: d.MQTTAddr(), Clients: 1, Count: 100, Window: 32, QoS: 2, Size: 16, Version: 3})
	if err != nil {
		t.Fatal(err)
	}
	if res.Acked != 100 || res.Failed != 0 {
		t.Fatalf("QoS 2: acked %d of 100, %d failed (%s)", res.Acked, res.Failed, res.FirstFailure)
	}
}
