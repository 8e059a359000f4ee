package daemon

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/tandem-edge/tandem/bench"
	"github.com/tandem-edge/tandem/config"
)

func TestBenchAgainstAGateway(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	for _, v := range []string{"3", "5"} {
		// The subscriber's default Receive Maximum of 20: the one that
		// deadlocked the mochi-based layer (FACTS.md).
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
	for _, args := range [][]string{{"--subscribe-qos", "3"}, {"--subscriber-receive-max", "0"}, {"--subscribers", "-1"}, {"--clients", "0"}} {
		if code, _, _ := runMain(t, append([]string{"bench"}, args...)...); code != ExitUsage {
			t.Fatalf("%v: exit %d, want 2", args, code)
		}
	}
}

// --subscribers, --subscribe-qos and --idle through the command line: QoS 0
// subscriptions (QoS 1 ones with a small Receive Maximum are tested against
// Mosquitto in bench/, until the new MQTT layer lands).
func TestBenchFanOutAndIdleFlags(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	code, out, stderr := runMain(t, "bench", "--broker", d.MQTTAddr(), "--clients", "2", "--count", "50", "--window", "4",
		"--qos", "1", "--subscribers", "3", "--subscribe-qos", "0", "--idle", "20", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var r bench.Result
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("bench --json printed %q: %v", out, err)
	}
	if r.Acked != 100 || r.Subscribers != 3 || r.SubscribeQoS != 0 || r.DeliveredQoS != 0 || r.Received == 0 || r.DeliveriesPerSec <= 0 {
		t.Fatalf("fan-out: %+v", r)
	}
	if r.Idle != 20 || r.IdleOpen != 20 {
		t.Fatalf("idle: %+v", r)
	}
	code, out, stderr = runMain(t, "bench", "--broker", d.MQTTAddr(), "--clients", "0", "--idle", "5")
	if code != 0 || !strings.Contains(out, "5 idle connections") || !strings.Contains(out, "5 still open") || strings.Contains(out, "throughput") {
		t.Fatalf("idle only: exit %d %q %s", code, out, stderr)
	}
	code, out, stderr = runMain(t, "bench", "--broker", d.MQTTAddr(), "--count", "10", "--subscribers", "2", "--subscribe-qos", "0")
	if code != 0 || !strings.Contains(out, "deliveries/s") || !strings.Contains(out, "2 subscribers") {
		t.Fatalf("human output: exit %d %q %s", code, out, stderr)
	}
}

// An MQTT 3.1.1 client has no receive maximum to respect: one that keeps
// more publishes in flight than max_inflight is slowed down, not dropped.
func TestMQTT311ClientOverReceiveMaximumIsSlowedNotDropped(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) { c.MQTT.MaxInflight = 4 })
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

// A run in which the broker refused every publish exits 1 and says why
// (here: disconnected for a packet over max_packet_size), not just "context
// deadline exceeded"; --count 0 with no --duration is refused before
// anything is sent.
func TestBenchFailsWhenPublishesFailAndSaysWhy(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	for _, v := range []string{"5", "3"} {
		code, out, stderr := runMain(t, "bench", "--broker", d.MQTTAddr(), "--count", "5", "--size", "2000000", "--mqtt-version", v)
		if code != ExitFailure {
			t.Fatalf("MQTT %s, every publish over max_packet_size: exit %d, want 1\n%s%s", v, code, out, stderr)
		}
		if !strings.Contains(stderr, "5 of 5 publishes failed") {
			t.Errorf("MQTT %s: stderr does not count the failures: %q", v, stderr)
		}
		want := "packet too large"
		if v == "3" {
			want = "connection lost" // 3.1.1 has no DISCONNECT from the server: the broker just closes
		}
		if !strings.Contains(stderr, want) || strings.Contains(stderr, "deadline exceeded") {
			t.Errorf("MQTT %s: stderr %q does not say %q", v, stderr, want)
		}
	}
	code, out, stderr := runMain(t, "bench", "--broker", d.MQTTAddr(), "--count", "0")
	if code != ExitUsage || !strings.Contains(stderr, "--duration") || out != "" {
		t.Fatalf("--count 0 without --duration: exit %d, stdout %q, stderr %q", code, out, stderr)
	}
	if code, _, stderr := runMain(t, "bench", "--broker", d.MQTTAddr(), "--count", "-1"); code != ExitUsage {
		t.Fatalf("--count -1: exit %d %s", code, stderr)
	}
}

// --metrics reads a gateway's written-bytes counters around the run: what
// its storage layer wrote per acked publish, by file (#36).
func TestBenchReportsTheStorageWritesOfAGateway(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	code, out, stderr := runMain(t, "bench", "--broker", d.MQTTAddr(), "--clients", "2", "--count", "50",
		"--qos", "1", "--metrics", d.HTTPAddr(), "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var r bench.Result
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("bench --json printed %q: %v", out, err)
	}
	// Two clients, one publish in flight each: a WAL page per fdatasync
	// of one or two publishes.
	if w := r.StorageWritten; w == nil || w.WAL < 1024 || w.Snapshot != 0 {
		t.Fatalf("storage written per publish: %+v", w)
	}
	code, out, _ = runMain(t, "bench", "--broker", d.MQTTAddr(), "--count", "10", "--metrics", d.HTTPAddr())
	if code != 0 || !strings.Contains(out, "B written per publish (WAL ") {
		t.Fatalf("human output: %d %q", code, out)
	}
}
