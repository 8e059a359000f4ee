package admin

import (
	"sort"

	"github.com/prometheus/client_golang/prometheus"
)

// PeerPortSource is what the peer port's refusal counters are read from:
// pairing attempts by outcome and stranger connections refused or
// evicted by reason, each a running total since the start.
type PeerPortSource interface {
	PairGuesses() map[string]uint64
	StrangerRefusals() map[string]uint64
}

// RegisterPeerPort adds tandem_pair_guesses_total{outcome} and
// tandem_peer_stranger_refusals_total{reason}.
func (fv *FieldView) RegisterPeerPort(src PeerPortSource) {
	fv.reg.MustRegister(peerPortCollector{src})
}

type peerPortCollector struct{ src PeerPortSource }

var (
	descPairGuesses = desc("tandem_pair_guesses_total", "Pairing attempts the master answered, by outcome: right or wrong (checked), over_cap (refused unchecked: over the cap of one checked guess a second from all addresses), closed (no pairing open, expired, used, or closed by 5 wrong codes).", "outcome")
	descStrangers   = desc("tandem_peer_stranger_refusals_total", "Peer port connections not yet proven a member's that were refused (per_address: the address held its peer.max_strangers_per_address; full: every peer.max_strangers slot held, none to evict) or evicted (a newcomer from an address holding none took the slot).", "reason")
)

// Describe implements prometheus.Collector.
func (peerPortCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descPairGuesses
	ch <- descStrangers
}

// Collect implements prometheus.Collector.
func (c peerPortCollector) Collect(ch chan<- prometheus.Metric) {
	for _, m := range []struct {
		d *prometheus.Desc
		n map[string]uint64
	}{{descPairGuesses, c.src.PairGuesses()}, {descStrangers, c.src.StrangerRefusals()}} {
		keys := make([]string, 0, len(m.n))
		for k := range m.n {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			ch <- prometheus.MustNewConstMetric(m.d, prometheus.CounterValue, float64(m.n[k]), k)
		}
	}
}
