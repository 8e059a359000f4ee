package admin

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/replication"
)

// The status page's history: one sample every sampleEvery, the last
// historySize of them (10 minutes), a few KiB in all.
const (
	sampleEvery = 5 * time.Second
	historySize = 120
)

// sample is one point of the status page's sparklines.
type sample struct {
	At         time.Time
	In         float64 // publishes taken per second since the previous sample
	Acks       float64 // successful acks per second
	LagRecords uint64  // the most any member lags, in records
	LagSeconds float64 // and in seconds
	Backlog    int64   // the uplinks' backlog, in records (uplinkpage.go)
}

// history is a ring of samples plus the per-rule rates of the last
// interval. Written by the sampler, read by page requests.
type history struct {
	mu  sync.Mutex // guards the fields below
	buf []sample
	n   int // samples held, up to len(buf)
	end int // where the next sample goes
	// ruleRates[i+1] is topic rule i's publishes per second over the last
	// interval, ruleRates[0] the unmatched ones'; rulesOf is the config
	// they were counted under (a reload renumbers the rules), nil before
	// the first interval.
	ruleRates []float64
	rulesOf   *config.Config
}

func newHistory(size int) *history { return &history{buf: make([]sample, size)} }

func (h *history) add(s sample, ruleRates []float64, rulesOf *config.Config) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.buf[h.end] = s
	h.end = (h.end + 1) % len(h.buf)
	h.n = min(h.n+1, len(h.buf))
	h.ruleRates, h.rulesOf = ruleRates, rulesOf
}

// samples returns the samples held, oldest first.
func (h *history) samples() []sample {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]sample, 0, h.n)
	for i := range h.n {
		out = append(out, h.buf[(h.end-h.n+i+len(h.buf))%len(h.buf)])
	}
	return out
}

// rates returns the per-rule rates if they were counted under the config
// live is, nil otherwise.
func (h *history) rates(live *config.Config) []float64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.rulesOf != live {
		return nil
	}
	return h.ruleRates
}

// sampler is what the sampling goroutine remembers between two samples.
type sampler struct {
	at      time.Time
	rules   [maxRuleCounts + 1]uint64
	acks    uint64
	live    *config.Config
	stopped int // samples in a row that found the node stopped
}

// stoppedFor is how many samples in a row must find the node stopped for
// the sampler to end on its own, should Daemon.Stop not call stop: more
// than a join's or a removal's node swap lasts.
const stoppedFor = 3

// start starts the sampler, once.
func (fv *FieldView) start() {
	fv.startOnce.Do(func() {
		fv.wg.Add(1)
		go fv.sampleLoop()
	})
}

// Stop stops the sampler and waits for it. Daemon.Stop calls it; safe to
// call more than once, and before start.
func (fv *FieldView) Stop() {
	fv.stopOnce.Do(func() { close(fv.stopc) })
	fv.wg.Wait()
}

func (fv *FieldView) sampleLoop() {
	defer fv.wg.Done()
	t := time.NewTicker(sampleEvery)
	defer t.Stop()
	var sm sampler
	fv.sample(&sm, time.Now())
	for {
		select {
		case <-fv.stopc:
			return
		case now := <-t.C:
			fv.sample(&sm, now)
			if sm.stopped >= stoppedFor {
				return
			}
		}
	}
}

// sample takes one sample: counter deltas become rates, the status gives
// the lag. The first call only sets the baseline.
func (fv *FieldView) sample(sm *sampler, now time.Time) {
	live := fv.gw.Live()
	var rules [maxRuleCounts + 1]uint64
	for i := range rules {
		rules[i] = fv.ruleCounts[i].Load()
	}
	acks := fv.acksOK.Load()
	s := sample{At: now}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	st, err := fv.gw.Status(ctx)
	cancel()
	if err == nil {
		for _, m := range st.Members {
			s.LagRecords = max(s.LagRecords, m.LagRecords)
			s.LagSeconds = max(s.LagSeconds, m.LagSeconds)
		}
		s.Backlog = uplinkBacklog(st)
	}
	if errors.Is(err, replication.ErrStopped) {
		sm.stopped++
	} else {
		sm.stopped = 0
	}
	first := sm.at.IsZero()
	secs := now.Sub(sm.at).Seconds()
	var rates []float64
	if !first && secs > 0 {
		var in uint64
		for i := range rules {
			in += rules[i] - sm.rules[i]
		}
		s.In = float64(in) / secs
		s.Acks = float64(acks-sm.acks) / secs
		if live == sm.live {
			n := 1
			if live != nil {
				n = min(len(live.Topics)+1, len(rules))
			}
			rates = make([]float64, n)
			for i := range rates {
				rates[i] = float64(rules[i]-sm.rules[i]) / secs
			}
		}
	}
	sm.at, sm.rules, sm.acks, sm.live = now, rules, acks, live
	if first {
		return
	}
	fv.hist.add(s, rates, live)
}
