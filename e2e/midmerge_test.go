package e2e

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// A slave killed -9 while it merges a snapshot into its broker state in
// place (most of the state changed while it was away, storage's
// snapin.go) restarts with a state part old, part new. It must serve none
// of it: cut off from the master, so that no snapshot can come, it
// answers /healthz with 503 and refuses devices (0x9C naming the master,
// or 0x88 when it knows no other address) for as long as the cut lasts;
// healed, it gets a whole snapshot, installs it, and serves the master's
// retained messages, its data dir within the budget and its slack
// throughout. Slow flash (an fdatasync of 20 ms) makes the merge last
// long enough for the kill to land in it.
func TestSlaveKilledMidMergeServesNothingUntilAWholeSnapshot(t *testing.T) {
	netns.Skip(t, "iptables")
	// On a network of its own, mostly waiting: beside the other such tests.
	t.Parallel()
	const budget, count, size = 16 << 20, 2800, 1000
	const slowFlash = "TANDEM_BENCH_FSYNC_DELAY=20ms"
	nt := netns.New(t, 2)
	g1, g2 := budgetPair(t, nt)
	// Sessions that stay as they are, and retained messages that all
	// change while gw-2 is away: the changed part would not fit twice, so
	// gw-2 merges the snapshot in place.
	holdSessions(t, g1, 9, 100)
	all := make([]int, count)
	for j := range all {
		all[j] = j
	}
	retainMany(t, g1, all, func(j int) []byte { return []byte(strings.Repeat(string(rune('a'+j%26)), size)) })
	waitShape(t, g1, 0, 1, 30*time.Second)
	var before catchUpStatus
	if !g2.statusAs(&before) {
		t.Fatal("gw-2 does not answer")
	}
	g2.stop()
	retainMany(t, g1, all, func(int) []byte { return []byte(strings.Repeat("Z", size)) })
	floodUntil(t, g1, 2*budget, 30*time.Second)
	testutil.WaitFor(t, 30*time.Second, "gw-1 to drop what gw-2 lacks", func() bool { return firstIndex(g1) > before.Log.LastIndex+1 })

	peak := watchDir(g2.dir)
	defer peak.stop()
	g2.start(slowFlash)
	testutil.WaitFor(t, 60*time.Second, "gw-2 merging the master's snapshot in place", func() bool {
		return strings.Contains(g2.proc.Output(), "merging it in place")
	})
	g2.kill()
	nt.Cut(nt.Hosts[0], nt.Hosts[1])
	g2.start(slowFlash)
	if out := g2.proc.Output(); !strings.Contains(out, "was being merged into the broker state when this member stopped") {
		t.Fatalf("gw-2 restarted without noticing the merge the kill cut short (did the kill land after it?):\n%s", out)
	}
	// Cut off, with its state part old and part new: no device, for as
	// long as the cut lasts (three looks a second apart).
	for range 3 {
		if code := g2.healthz(); code != 503 {
			t.Fatalf("gw-2 with a merge cut short: /healthz %d, want 503", code)
		}
		ca, err := connackOf(g2, "midmerge-dev")
		if err == nil && ca.ReasonCode == 0 {
			t.Fatal("gw-2 with a merge cut short took a device")
		}
		if ca == nil {
			t.Fatalf("gw-2 with a merge cut short: CONNECT answered %v, want a CONNACK refusing it", err)
		}
		switch {
		case ca.ReasonCode == 0x9C && ca.Properties != nil && strings.Contains(ca.Properties.ServerReference, g1.h.Addr()+":1883"):
		case ca.ReasonCode == 0x88:
		default:
			t.Fatalf("gw-2 with a merge cut short: CONNACK %#x %+v, want 0x9C naming gw-1 or 0x88", ca.ReasonCode, ca.Properties)
		}
		var s catchUpStatus
		if !g2.statusAs(&s) || !s.Log.CatchingUp {
			t.Fatalf("gw-2's status with a merge cut short: %+v, want catching_up", s.Log)
		}
		time.Sleep(time.Second) // the span the refusal must hold over, not a synchronisation
	}

	nt.Heal(nt.Hosts[0], nt.Hosts[1])
	var s catchUpStatus
	testutil.WaitFor(t, 90*time.Second, "gw-2 to install a whole snapshot and serve again", func() bool {
		return g2.statusAs(&s) && !s.Log.CatchingUp && g2.healthz() == 200
	}, func() string { return fmt.Sprintf("status log %+v, /healthz %d", s.Log, g2.healthz()) })
	waitShape(t, g1, 0, 1, 30*time.Second)
	const sentinel = "ret/zz-after"
	publishRetained(t, g1, sentinel, "end")
	want, got := retainedSet(t, g1, sentinel), retainedSet(t, g2, sentinel)
	if len(want) != count+1 || !maps.Equal(got, want) {
		t.Errorf("gw-2 holds %d retained messages after the snapshot, gw-1 %d, want %d and the same", len(got), len(want), count+1)
	}
	for k, v := range got {
		if k != sentinel && v != strings.Repeat("Z", size) {
			t.Fatalf("gw-2 serves an old value of %s after the snapshot", k)
		}
	}
	top, n := peak.stop()
	limit := int64(budget + storage.RetentionSlack)
	t.Logf("gw-2's data dir: %d samples, peak %s; limit %d", n, top, limit)
	if top.total > limit {
		t.Errorf("gw-2's data dir reached %d bytes, past the budget and its slack (%d)", top.total, limit)
	}
	for _, g := range []*gw{g2, g1} {
		if g.status() == nil {
			t.Errorf("%s does not answer", g.name)
		}
		g.stop()
	}
}

// connackOf connects a device to g and returns the CONNACK, whatever its
// reason code (paho.golang answers a refusal with an error and it), then
// closes the connection.
func connackOf(g *gw, id string) (*paho.Connack, error) {
	conn, err := dialIn(g.h, g.h.Addr()+":1883")
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	c := paho.NewClient(paho.ClientConfig{ClientID: id, Conn: conn})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 30})
	if err == nil {
		c.Disconnect(&paho.Disconnect{})
	}
	return ca, err
}
