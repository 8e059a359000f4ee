package admin

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/replication"
)

func TestHotPathObserverDoesNotAllocate(t *testing.T) {
	fv := NewFieldView(nil, config.DefaultConfig(), slog.New(slog.DiscardHandler))
	var o mqtt.Observer = fv
	timeout := errors.Join(replication.ErrAckTimeout)
	allocs := testing.AllocsPerRun(1000, func() {
		o.Published(mqtt.Sync, 1, 0)
		o.Published(mqtt.Async, 2, -1)
		o.Acked(mqtt.Async, nil, 300*time.Microsecond)
		o.Acked(mqtt.Sync, timeout, 5*time.Second)
		fv.OnCommit(time.Millisecond, 64)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per publish, ack and commit, want 0", allocs)
	}
	if got := fv.ruleCounts[1].Load(); got != 1001 {
		t.Fatalf("rule 0 counted %d publishes, want 1001", got)
	}
}

// logLines is a slog handler that keeps the messages logged.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) Enabled(context.Context, slog.Level) bool { return true }
func (l *logLines) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		b.WriteString(" " + a.String())
		return true
	})
	l.mu.Lock()
	l.lines = append(l.lines, b.String())
	l.mu.Unlock()
	return nil
}
func (l *logLines) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logLines) WithGroup(string) slog.Handler      { return l }

func TestSlowFsyncLoggedWithoutStorm(t *testing.T) {
	var ll logLines
	fv := NewFieldView(nil, config.DefaultConfig(), slog.New(&ll))
	for range 500 {
		fv.OnCommit(10*time.Millisecond, 1) // fast: never logged
	}
	var wg sync.WaitGroup
	for range 4 { // commits come from one goroutine, but the limit must not rely on it
		wg.Go(func() {
			for range 250 {
				fv.OnCommit(1500*time.Millisecond, 8)
			}
		})
	}
	wg.Wait()
	// Which of the concurrent commits logs is a race: the line counts the
	// slow commits up to it (1 or a few), and the next line the rest.
	if len(ll.lines) != 1 || !strings.Contains(ll.lines[0], "slow fsync") {
		t.Fatalf("1000 slow commits at once logged %q, want one line", ll.lines)
	}
	// Once the interval has passed, the next slow commit is logged with
	// the count of those kept quiet meanwhile: every slow commit is
	// counted in exactly one line.
	fv.slowLogged.Add(-int64(slowFsyncEvery))
	fv.OnCommit(2*time.Second, 8)
	if len(ll.lines) != 2 || slowCommits(t, ll.lines[0])+slowCommits(t, ll.lines[1]) != 1001 {
		t.Fatalf("after the interval: %q, want a second line, the two counting 1001 slow commits", ll.lines)
	}
}

// slowCommits is the slow_commits count of a logged line.
func slowCommits(t *testing.T, line string) int {
	t.Helper()
	_, rest, ok := strings.Cut(line, "slow_commits=")
	n, err := strconv.Atoi(strings.Fields(rest + " ")[0])
	if !ok || err != nil {
		t.Fatalf("no slow_commits in %q", line)
	}
	return n
}

func TestHistoryRingAndSparkline(t *testing.T) {
	h := newHistory(4)
	t0 := time.Unix(1700000000, 0)
	for i := range 6 {
		h.add(sample{At: t0.Add(time.Duration(i) * sampleEvery), In: float64(i)}, nil, nil)
	}
	got := h.samples()
	if len(got) != 4 || got[0].In != 2 || got[3].In != 5 {
		t.Fatalf("ring of 4 after 6 samples: %+v, want samples 2…5 oldest first", got)
	}
	sl := newSparkline(got, func(s sample) float64 { return s.In }, "/s")
	pts := strings.Fields(sl.Points)
	if sl.Collecting || len(pts) != 4 || sl.Max != "5/s" || sl.Last != "5/s" {
		t.Fatalf("sparkline: %+v", sl)
	}
	// The newest point is at the right edge and at the top (the maximum).
	if last := pts[3]; last != "240,1.0" {
		t.Fatalf("newest point %q, want 240,1.0", last)
	}
	if sl := newSparkline(got[:1], func(s sample) float64 { return s.In }, ""); !sl.Collecting {
		t.Fatalf("one sample drew a line: %+v", sl)
	}
}
