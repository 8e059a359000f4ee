package uplink

import (
	"strconv"
	"testing"
	"time"
)

// BenchmarkReplay drains a backlog of b.N records to a local mosquitto at
// QoS 1 and reports the drain rate (U2's drain, without the gateway).
func BenchmarkReplay(b *testing.B) {
	for _, proto := range []string{"5", "3.1.1"} {
		b.Run(proto, func(b *testing.B) {
			c := startCloud(b)
			newRecorder(b, c, "#") // the cloud delivers to a subscriber, as it would
			l := newMemLog()
			payload := string(make([]byte, 100))
			for i := range b.N {
				l.add("p", "dev/a", payload[:90]+strconv.Itoa(i))
			}
			cfg := testConfig(c)
			cfg.Protocol = proto
			b.ResetTimer()
			start := time.Now()
			u := runUplink(b, cfg, l, &sink{}, nil, 0)
			deadline := time.Now().Add(time.Minute)
			for u.Counters().Forwarded < uint64(b.N) {
				if time.Now().After(deadline) {
					b.Fatalf("forwarded %d of %d in a minute", u.Counters().Forwarded, b.N)
				}
				time.Sleep(time.Millisecond) // polling the counter, not synchronising
			}
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msg/s")
			b.StopTimer()
		})
	}
}
