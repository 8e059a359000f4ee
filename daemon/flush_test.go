package daemon

import (
	"fmt"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
)

// flush: interval acks a publish once it is written: one client publishing
// QoS 1 one at a time costs an fdatasync per flush_interval, not per
// publish, and everything acked is in the log.
func TestFlushIntervalAcksBeforeTheFsync(t *testing.T) {
	const interval = 50 * time.Millisecond
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		c.Storage.Flush = "interval"
		c.Storage.FlushInterval = config.Duration(interval)
	})
	pub, _ := v5(t, d.MQTTAddr(), "fl", nil)
	before := statusOfGW(t, d).Storage
	start := time.Now()
	const n = 2000
	for i := range n {
		publish(t, pub, &paho.Publish{Topic: "fl/t", QoS: 1, Payload: fmt.Appendf(nil, "m%d", i)})
	}
	elapsed := time.Since(start)
	after := statusOfGW(t, d).Storage
	syncs, writes := after.Fsyncs-before.Fsyncs, after.Commits-before.Commits
	t.Logf("%d acked publishes in %v: %d writes, %d fdatasyncs (one per %v would be %.0f)", n, elapsed, writes, syncs, interval, float64(elapsed)/float64(interval))
	// Checkpoints into the data file (three fdatasyncs each) come on top.
	if max := 3*float64(elapsed)/float64(interval) + 30; float64(syncs) > max {
		t.Errorf("%d fdatasyncs for %d publishes in %v: more than one per flush_interval", syncs, n, elapsed)
	}
	if writes < n/4 {
		t.Errorf("%d writes for %d sequential publishes", writes, n)
	}
	got := 0
	for _, r := range logRecords(t, d) {
		if r.Topic == "fl/t" {
			got++
		}
	}
	if got != n {
		t.Errorf("%d of %d acked publishes in the log", got, n)
	}
}
