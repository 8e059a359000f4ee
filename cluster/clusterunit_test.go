package cluster

import (
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/clock"
)

func TestKnockPacingGrowsWithRoundTripAndFailures(t *testing.T) {
	if got := knockTimeout(0, 0); got != knockTimeoutMin {
		t.Errorf("unmeasured link: %v, want %v", got, knockTimeoutMin)
	}
	// 400 ms one way: a knock costs about 3.2 s; its timeout must cover
	// that with room to spare (the fault run's knocks had 3 s).
	if got := knockTimeout(800*time.Millisecond, 0); got < 6*time.Second {
		t.Errorf("800 ms round trip: %v, want at least 6s", got)
	}
	prev := time.Duration(0)
	for f := 0; f < 12; f++ {
		got := knockTimeout(time.Second, f)
		if got < prev || got > knockTimeoutMax {
			t.Errorf("after %d failures: %v (before: %v, max %v)", f, got, prev, knockTimeoutMax)
		}
		prev = got
	}
	if prev != knockTimeoutMax {
		t.Errorf("after many failures: %v, want the ceiling %v", prev, knockTimeoutMax)
	}
	if rejoinInterval(0) != rejoinEvery || rejoinInterval(1) <= rejoinEvery || rejoinInterval(50) != rejoinEveryMax {
		t.Errorf("backoff: %v %v %v", rejoinInterval(0), rejoinInterval(1), rejoinInterval(50))
	}
	var r rttEstimate
	r.observe(100 * time.Millisecond)
	for range 50 {
		r.observe(2 * time.Second)
	}
	if got := r.get(); got < 1500*time.Millisecond {
		t.Errorf("smoothed round trip after a slow link: %v", got)
	}
	// A link that just slowed down: one sample of 2 s after a fast
	// history. A knock (about four round trips) must fit in the timeout
	// at once, not eight samples later.
	var fast rttEstimate
	for range 20 {
		fast.observe(time.Millisecond)
	}
	fast.observe(2 * time.Second)
	if got := knockTimeout(fast.patience(), 0); got < 4*2*time.Second {
		t.Errorf("knock timeout right after the link slowed to a 2 s round trip: %v, less than a knock's four round trips", got)
	}
	fast.observe(time.Millisecond)
	if got := fast.patience(); got > time.Second {
		t.Errorf("patience after the link is fast again: %v", got)
	}
	var rl rateLimit
	if !rl.allow(time.Hour) || rl.allow(time.Hour) {
		t.Error("rate limit: first event must pass, the second not")
	}
}

func TestInviteBookRefusesExpiredAndReused(t *testing.T) {
	var b inviteBook
	now := time.Now()
	b.add([]byte("0123456789abcdef"), now.Add(time.Minute))
	if _, err := b.claim([]byte("0123456789abcdeX"), 1, now); err == nil {
		t.Fatal("an unknown secret was accepted")
	}
	if _, err := b.claim([]byte("0123456789abcdef"), 1, now.Add(2*time.Minute)); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("expired secret: %v", err)
	}
	if _, err := b.claim([]byte("0123456789abcdef"), 1, now); err != nil {
		t.Fatal(err)
	}
	if _, err := b.claim([]byte("0123456789abcdef"), 1, now); err != nil {
		t.Fatalf("the same node retrying: %v", err)
	}
	if _, err := b.claim([]byte("0123456789abcdef"), 2, now); err == nil || !strings.Contains(err.Error(), "already used") {
		t.Fatalf("reused secret: %v", err)
	}
}

// A failover probe that fails while the master's heartbeat arrives in its
// middle must not promote: the master spoke, so it is alive, even if its
// silence at the end of the probe is longer than failover_after.
func TestFailoverNotTakenForAMasterHeardDuringTheProbe(t *testing.T) {
	after := 3 * time.Second
	var f failoverState
	f.heard.Store(int64(clock.Mono() - 10*time.Second)) // silent for 10 s when the probe starts
	mark := f.heard.Load()
	if f.spokeSince(mark, after) {
		t.Fatal("a master silent all through the probe counted as alive")
	}
	// A heartbeat 4 s ago, during the probe: the silence is still over
	// failover_after at its end.
	f.heard.Store(int64(clock.Mono() - 4*time.Second))
	if !f.spokeSince(mark, after) {
		t.Fatalf("a master heard during the probe counted as dead (silent %v at the end, failover_after %v)", f.silence(), after)
	}
}
