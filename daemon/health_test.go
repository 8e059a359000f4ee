package daemon

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// healthz returns a gateway's /healthz status code and body.
func healthz(t *testing.T, d *Daemon) (int, string) {
	t.Helper()
	resp, err := (&http.Client{Timeout: 2 * time.Second}).Get("http://" + d.HTTPAddr() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(body))
}

// statusPage returns a gateway's status page.
func statusPage(t *testing.T, d *Daemon) string {
	t.Helper()
	resp, err := (&http.Client{Timeout: 2 * time.Second}).Get("http://" + d.HTTPAddr() + "/")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return string(body)
}

// A 2-gateway slave whose master is gone refuses every publish after
// sync_timeout: /healthz, the status JSON and the page say so (503, the
// reason, no master named) until `tandem promote` makes it the master.
func TestHealthSaysNoMasterReachableWhileTheSlaveTakesNoPublishes(t *testing.T) {
	// An election timeout longer than the second promote has to make the
	// slave a master that names itself.
	g1, g2 := inProcessPair(t, func(c *config.Config) {
		c.Cluster.Heartbeat = config.Duration(100 * time.Millisecond)
		c.Cluster.ElectionTimeout = config.Duration(2 * time.Second)
	})
	var s *admin.Status
	testutil.WaitFor(t, 2*time.Second, "the slave of a live master serving, naming it", func() bool {
		s = statusOfGW(t, g2.d)
		return s.Serving == admin.ServingAll && s.NotServing == nil && s.Leader != nil && s.Leader.Name == "gw-1"
	}, func() string { return fmt.Sprintf("serving %q (%v), master %+v", s.Serving, s.NotServing, s.Leader) })
	if code, body := healthz(t, g2.d); code != 200 {
		t.Fatalf("slave of a live master: /healthz %d %q", code, body)
	}
	pub, _ := v5(t, g2.d.MQTTAddr(), "health-pub", nil)

	g1.d.Stop()
	gone := time.Now()
	within := g2.d.cfg.Cluster.SyncTimeout.Duration() + time.Second
	var code int
	var body string
	testutil.WaitFor(t, within, "the slave's /healthz 503", func() bool {
		code, body = healthz(t, g2.d)
		return code == http.StatusServiceUnavailable
	}, func() string { return body })
	t.Logf("503 %v after the master stopped: %q", time.Since(gone).Round(time.Millisecond), body)
	if !strings.Contains(body, "no master reachable") || !strings.Contains(body, "gw-1") || !strings.Contains(body, "tandem promote") {
		t.Fatalf("/healthz reason %q: want no master reachable, naming gw-1 and the way out", body)
	}
	s = statusOfGW(t, g2.d)
	if s.Serving != admin.ServingSubscribers || s.NotServing == nil || *s.NotServing != body {
		t.Fatalf("status serving %q, not_serving %v: want %q, %q", s.Serving, s.NotServing, admin.ServingSubscribers, body)
	}
	if s.Leader != nil {
		t.Fatalf("status names master %+v, which is gone", s.Leader)
	}
	for _, m := range s.Members {
		if m.MatchKnown {
			t.Errorf("a slave claims to know %s's match index (%d)", m.Name, m.MatchIndex)
		}
	}
	if page := statusPage(t, g2.d); !strings.Contains(page, "master: <b>none</b>") || !strings.Contains(page, body) {
		t.Fatalf("the page names a master or hides the reason %q", body)
	}
	// What /healthz says is what a device meets.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	r, err := pub.Publish(ctx, &paho.Publish{Topic: "a/while-gone", QoS: 1, Payload: []byte("x")})
	cancel()
	if r == nil || r.ReasonCode != 0x80 {
		t.Fatalf("publish while /healthz says %q: %+v %v, want reason 0x80", body, r, err)
	}

	var pr admin.PromoteResponse
	if code, msg := api(t, g2.d, "/v1/cluster/promote", admin.PromoteRequest{}, &pr); code != 200 {
		t.Fatalf("promote: %d %q", code, msg)
	}
	promoted := time.Now()
	testutil.WaitFor(t, time.Second, "the promoted slave's /healthz 200", func() bool {
		code, body = healthz(t, g2.d)
		return code == 200
	}, func() string { return body })
	t.Logf("200 %v after promote", time.Since(promoted).Round(time.Millisecond))
	testutil.WaitFor(t, time.Second, "the promoted slave serving, naming itself master", func() bool {
		s = statusOfGW(t, g2.d)
		return s.Serving == admin.ServingAll && s.Leader != nil && s.Leader.Name == "gw-2"
	}, func() string { return fmt.Sprintf("serving %q (%v), master %+v", s.Serving, s.NotServing, s.Leader) })
	if r := publish(t, pub, &paho.Publish{Topic: "a/after", QoS: 1, Payload: []byte("y")}); r.ReasonCode != 0 {
		t.Fatalf("publish on the promoted master: reason %#x", r.ReasonCode)
	}
}
