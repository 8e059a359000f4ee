package admin

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tandem-edge/tandem/internal/clock"
)

// RegisterClock adds the gateway clock's metrics (internal/clock):
// tandem_clock_jumps_total, the wall-clock jumps it absorbed, and
// tandem_clock_offset_seconds, what it adds to the wall clock for them.
func (fv *FieldView) RegisterClock(c *clock.Clock) {
	fv.reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "tandem_clock_jumps_total",
			Help: "Jumps of the wall clock (forward or back, over 1 s beyond what the monotonic clock measured) the gateway absorbed: records are stamped and aged on a time of day that runs on without them."},
			func() float64 { return float64(c.Jumps()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "tandem_clock_offset_seconds",
			Help: "What the gateway's time of day (record times, max_age, message expiry) adds to the host's wall clock: the jumps it absorbed, negated; kept in the data dir across restarts."},
			func() float64 { return c.Offset().Seconds() }),
	)
}
