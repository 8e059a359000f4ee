package admin

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tandem-edge/tandem/uplink"
)

// UplinkSource is what the tandem_uplink_* metrics read: every uplink's
// state and running totals.
type UplinkSource interface {
	Uplinks() []UplinkMetrics
}

// UplinkMetrics is one uplink as the metrics see it.
type UplinkMetrics struct {
	Status   uplink.Status
	Counters uplink.Counters
}

// RegisterUplinks adds the tandem_uplink_* metrics, labelled by uplink
// name: gauges from the uplinks' Status, counters from their Counters.
func (fv *FieldView) RegisterUplinks(src UplinkSource) {
	fv.reg.MustRegister(uplinkCollector{src})
}

type uplinkCollector struct{ src UplinkSource }

var (
	upConnected = desc("tandem_uplink_connected", "1 while the uplink is connected to its cloud broker.", "uplink")
	upRunning   = desc("tandem_uplink_running", "1 while the uplink runs (on the master).", "uplink")
	upPaused    = desc("tandem_uplink_paused", "1 while `tandem uplink pause` holds the uplink back.", "uplink")
	upFull      = desc("tandem_uplink_backlog_full", "1 while the backlog is at max_backlog.", "uplink")
	upRecords   = desc("tandem_uplink_backlog_records", "Records waiting to go to the cloud.", "uplink")
	upBytes     = desc("tandem_uplink_backlog_bytes", "Log bytes of the records waiting to go to the cloud.", "uplink")
	upOldest    = desc("tandem_uplink_oldest_age_seconds", "Age of the oldest record waiting to go to the cloud.", "uplink")
	upRate      = desc("tandem_uplink_forward_rate", "Messages acked by the cloud per second, over the last second.", "uplink")
	upPosition  = desc("tandem_uplink_position", "The log index up to which everything is dealt with.", "uplink")

	upCounters = []struct {
		d *prometheus.Desc
		v func(c *uplink.Counters) uint64
	}{
		{desc("tandem_uplink_forwarded_total", "Messages acked by the cloud.", "uplink"), func(c *uplink.Counters) uint64 { return c.Forwarded }},
		{desc("tandem_uplink_forwarded_bytes_total", "Payload bytes of the messages acked by the cloud.", "uplink"), func(c *uplink.Counters) uint64 { return c.ForwardedBytes }},
		{desc("tandem_uplink_resent_total", "Messages sent again after a reconnect: duplicates the cloud may see.", "uplink"), func(c *uplink.Counters) uint64 { return c.Resent }},
		{desc("tandem_uplink_dropped_total", "Records skipped by on_full: drop_oldest.", "uplink"), func(c *uplink.Counters) uint64 { return c.Dropped }},
		{desc("tandem_uplink_lost_total", "Log indexes retention dropped before they were forwarded.", "uplink"), func(c *uplink.Counters) uint64 { return c.Lost }},
		{desc("tandem_uplink_connects_total", "Connections to the cloud established.", "uplink"), func(c *uplink.Counters) uint64 { return c.Connects }},
		{desc("tandem_uplink_connect_failures_total", "Connection attempts that failed.", "uplink"), func(c *uplink.Counters) uint64 { return c.ConnectFailures }},
		{desc("tandem_uplink_disconnects_total", "Established connections that ended.", "uplink"), func(c *uplink.Counters) uint64 { return c.Disconnects }},
		{desc("tandem_uplink_downlink_received_total", "Downlink messages published here and acked to the cloud.", "uplink"), func(c *uplink.Counters) uint64 { return c.DownlinkReceived }},
		{desc("tandem_uplink_downlink_failed_total", "Downlink messages whose local publish failed (left unacked at the cloud).", "uplink"), func(c *uplink.Counters) uint64 { return c.DownlinkFailed }},
	}
)

// Describe implements prometheus.Collector.
func (uplinkCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{upConnected, upRunning, upPaused, upFull, upRecords, upBytes, upOldest, upRate, upPosition} {
		ch <- d
	}
	for _, c := range upCounters {
		ch <- c.d
	}
}

// Collect implements prometheus.Collector.
func (c uplinkCollector) Collect(ch chan<- prometheus.Metric) {
	for _, u := range c.src.Uplinks() {
		s, n := &u.Status, u.Status.Name
		ch <- gauge(upConnected, b2f(s.Connected), n)
		ch <- gauge(upRunning, b2f(s.Running), n)
		ch <- gauge(upPaused, b2f(s.Paused), n)
		ch <- gauge(upFull, b2f(s.Full), n)
		ch <- gauge(upRecords, float64(s.BacklogRecords), n)
		ch <- gauge(upBytes, float64(s.BacklogBytes), n)
		ch <- gauge(upOldest, s.OldestAgeSeconds, n)
		ch <- gauge(upRate, s.Rate, n)
		ch <- gauge(upPosition, float64(s.Position), n)
		for _, k := range upCounters {
			ch <- prometheus.MustNewConstMetric(k.d, prometheus.CounterValue, float64(k.v(&u.Counters)), n)
		}
	}
}
