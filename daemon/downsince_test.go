package daemon

import (
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// A member that stops is shown as down since when its link went, on the
// master and, for the master, on the slave (2 gateways: the slave keeps
// naming its master, so status must say that master is gone), instead of
// a stale match and lag; the text status says it in words, with the
// cluster's generation.
func TestStoppedMemberShownDownSince(t *testing.T) {
	g1, g2 := twoGateways(t, "gw-down")
	stopped := time.Now()
	if err := g2.Stop(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "gw-down-2 down since its stop, on the master", func() bool {
		for _, m := range statusOfGW(t, g1).Members {
			if m.Name == "gw-down-2" && !m.Reachable && m.DownSince != nil {
				return !m.DownSince.Before(stopped.Add(-time.Second)) && !m.DownSince.After(time.Now())
			}
		}
		return false
	})
	code, out, errs := runMain(t, "status", "--http", g1.HTTPAddr())
	if code != 0 {
		t.Fatalf("tandem status: %d %s", code, errs)
	}
	if !strings.Contains(out, "down since") || !strings.Contains(out, "generation ") {
		t.Fatalf("tandem status does not say the member is down since, or the generation:\n%s", out)
	}

	m1, s1 := twoGateways(t, "gw-dead")
	if err := m1.Stop(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "the slave showing its master down", func() bool {
		for _, m := range statusOfGW(t, s1).Members {
			if m.Name == "gw-dead-1" {
				return !m.Reachable && m.DownSince != nil
			}
		}
		return false
	})
}
