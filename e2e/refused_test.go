package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// Refused means absent (issue #32; DESIGN.md "Guarantees"): a publish
// whose device was told it failed is never delivered, never in any
// member's log, whatever path could have logged it later.

// outcomes is a publisher's record of every publish's answer.
type outcomes struct {
	mu      sync.Mutex
	acked   map[string]time.Time
	refused map[string]byte // payload → reason code
	order   []string        // acked payloads in publish order
	unknown int             // connection lost before the answer
	stopc   chan struct{}
	done    chan struct{}
}

// startOutcomePublisher publishes QoS 1 on topic from id at g, one in
// flight, reconnecting to g when its connection is lost, and records
// each answer.
func startOutcomePublisher(t *testing.T, g *gw, id, topic string) *outcomes {
	o := &outcomes{acked: map[string]time.Time{}, refused: map[string]byte{}, stopc: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(o.done)
		var c *paho.Client
		for seq := 0; ; seq++ {
			select {
			case <-o.stopc:
				return
			default:
			}
			if c == nil {
				var err error
				if c, err = device(t, g, id, nil); err != nil {
					select {
					case <-o.stopc:
						return
					case <-time.After(100 * time.Millisecond): // a retry pace, not a wait for anything
					}
					continue
				}
			}
			p := fmt.Sprintf("%s-%d", id, seq)
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			r, err := c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(p)})
			cancel()
			o.mu.Lock()
			switch {
			case err != nil && r == nil:
				o.unknown++
				c = nil
			case r.ReasonCode < 0x80:
				o.acked[p] = time.Now()
				o.order = append(o.order, p)
			default:
				o.refused[p] = r.ReasonCode
			}
			o.mu.Unlock()
		}
	}()
	t.Cleanup(func() { o.stop() })
	return o
}

func (o *outcomes) stop() {
	select {
	case <-o.stopc:
	default:
		close(o.stopc)
	}
	<-o.done
}

func (o *outcomes) count() (acked, refused int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.acked), len(o.refused)
}

// TestPausedMasterLogsNothingItRefused: three gateways, sync and async
// publishers on the master; the master is paused (SIGSTOP) for a seeded 2
// to 4 s, long enough for the others to elect a master, and resumed. What
// it refused its devices (0x80 after sync_timeout, or anything else) is in
// no member's log, and every acked record is in every member's; each
// member stops on SIGTERM in 5 s.
func TestPausedMasterLogsNothingItRefused(t *testing.T) {
	// On a network of its own, mostly waiting: beside the other such tests
	// (make test's time).
	t.Parallel()
	seed := testSeed(t, "TANDEM_PAUSE_SEED")
	rng := rand.New(rand.NewPCG(seed, seed>>1))
	pause := 2*time.Second + time.Duration(rng.IntN(2000))*time.Millisecond
	t.Logf("seed %d (replay with TANDEM_PAUSE_SEED=%d): pause %v", seed, seed, pause)

	g1, g2, g3 := threeOf(t, tandemBin(t))
	gws := []*gw{g1, g2, g3}
	m := masterOf(t, 15*time.Second, gws...)
	// Several sync publishers: each has one publish in flight, which the
	// pause may catch in the master's tail, not yet on a slave.
	var syncPubs []*outcomes
	for i := range 6 {
		syncPubs = append(syncPubs, startOutcomePublisher(t, m, fmt.Sprintf("paused-sync-%d", i), fmt.Sprintf("s/paused/%d", i)))
	}
	syncPub := syncPubs[0]
	asyncPub := startOutcomePublisher(t, m, "paused-async", "a/paused")
	testutil.WaitFor(t, 10*time.Second, "50 acks of each before the pause", func() bool {
		s, _ := syncPub.count()
		a, _ := asyncPub.count()
		return s >= 50 && a >= 50
	})
	pid := m.proc.Cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	var others []*gw
	for _, g := range gws {
		if g != m {
			others = append(others, g)
		}
	}
	waitMaster(t, time.Now().Add(15*time.Second), others...)
	paused := time.Now()
	testutil.WaitFor(t, pause+5*time.Second, "the seeded pause", func() bool { return time.Since(paused) >= pause })
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// On: until the resumed member's devices are acked again, and past its
	// sync_timeout (5 s), when what it held is answered.
	resumed := time.Now()
	s0, _ := syncPub.count()
	testutil.WaitFor(t, 30*time.Second, "sync acks again after the resume, past sync_timeout", func() bool {
		s, _ := syncPub.count()
		return s > s0+20 && time.Since(resumed) > 7*time.Second
	})
	for _, o := range syncPubs {
		o.stop()
	}
	asyncPub.stop()
	converge(t, 30*time.Second, gws...)
	for _, g := range gws {
		g.stopWithin(5 * time.Second)
	}
	for _, o := range append(syncPubs, asyncPub) {
		checkRefusedAbsent(t, o, gws...)
	}
}

// checkRefusedAbsent fails unless every payload o was refused is absent
// from every member's log and every one it was acked is present.
func checkRefusedAbsent(t *testing.T, o *outcomes, gws ...*gw) {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, g := range gws {
		logged := payloads(t, g)
		var present, missing []string
		for p, code := range o.refused {
			if logged[p] > 0 {
				present = append(present, fmt.Sprintf("%s(%#x)", p, code))
			}
		}
		for p := range o.acked {
			if logged[p] == 0 {
				missing = append(missing, p)
			}
		}
		if len(present) > 0 || len(missing) > 0 {
			t.Errorf("%s: %d refused publishes in its log: %s; %d acked ones missing: %s", g.name, len(present), strings.Join(first(present, 10), " "), len(missing), strings.Join(first(missing, 10), " "))
		}
	}
	t.Logf("%d acked, %d refused, %d without an answer", len(o.acked), len(o.refused), o.unknown)
}

func first(s []string, n int) []string { return s[:min(n, len(s))] }
