package e2e

import (
	"bytes"
	"context"
	"fmt"
	"html"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// healthzBody asks g's /healthz: its status code and body, 0 when it does
// not answer.
func (g *gw) healthzBody() (int, string) {
	resp, err := g.http.Get("http://127.0.0.1:7880/healthz")
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// waitHealthz waits until g's /healthz answers code, and returns the body.
func waitHealthz(t *testing.T, g *gw, code int, within time.Duration) string {
	t.Helper()
	var got int
	var body string
	testutil.WaitFor(t, within, fmt.Sprintf("%s /healthz %d", g.name, code), func() bool {
		got, body = g.healthzBody()
		return got == code
	}, func() string { return fmt.Sprintf("%d %q", got, body) })
	return body
}

// chromiumBin is the headless browser, or a skip without one (CI installs
// it, so there it fails instead).
func chromiumBin(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("chromium not found, and CI installs it: the status page cannot be checked")
	}
	t.Skip("chromium not found (apt-get install chromium): the status page is not checked in a browser")
	return ""
}

// pageHealth is what g's status page, rendered by headless Chromium in g's
// namespace, shows of g itself: whether its health cell is green, its text,
// and the master named in the header.
type pageHealth struct {
	OK             bool
	Health, Master string
}

var (
	selfRowRE    = regexp.MustCompile(`(?s)<tr data-node="[^"]*" data-role="[^"]*">\s*<td><b>[^<]*</b> <span class="dim">\(here\)</span>.*?<td class="(ok|bad)"><span class="dot"></span>([^<]*)</td>`)
	pageMasterRE = regexp.MustCompile(`master: <b>([^<]*)</b>`)
)

func (g *gw) page(t *testing.T, bin string) pageHealth {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := g.h.Command(bin, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
		"--user-data-dir="+t.TempDir(), "--dump-dom", "http://127.0.0.1:7880/")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("chromium: %v\n%s", err, errb.String())
		}
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		<-done
		t.Fatal("chromium did not finish within 60 s")
	}
	dom := out.String()
	row, master := selfRowRE.FindStringSubmatch(dom), pageMasterRE.FindStringSubmatch(dom)
	if row == nil || master == nil {
		t.Fatalf("%s's page: no row for itself or no master in:\n%s", g.name, dom)
	}
	return pageHealth{OK: row[1] == "ok", Health: html.UnescapeString(row[2]), Master: html.UnescapeString(master[1])}
}

// statusLine is the value of `tandem status`'s line named key.
func statusLine(out, key string) string {
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == key {
			return strings.TrimSpace(strings.TrimPrefix(l, key))
		}
	}
	return ""
}

// With the master of two gateways killed, its slave refuses every publish
// after sync_timeout: /healthz, the page and `tandem status` say so, and
// stop naming the dead master, until `tandem promote`.
func TestTwoGatewaysHealthWhenTheMasterDies(t *testing.T) {
	// On a network of its own, mostly waiting: beside the other such tests
	// (make test's time).
	t.Parallel()
	nt := netns.New(t, 2)
	browser := chromiumBin(t)
	g1, g2 := startPair(t, nt)
	waitHealthz(t, g2, 200, 5*time.Second)
	if p := g2.page(t, browser); !p.OK || p.Health != "serving" || p.Master != "gw-1" {
		t.Fatalf("the slave of a live master: page %+v", p)
	}

	g1.kill() // SIGKILL, by its PID
	killed := time.Now()
	body := waitHealthz(t, g2, 503, 5*time.Second+time.Second) // sync_timeout + 1 s
	t.Logf("503 %v after the kill: %q", time.Since(killed).Round(time.Millisecond), body)
	if !strings.Contains(body, "no master reachable") {
		t.Fatalf("/healthz 503 %q: want the reason, no master reachable", body)
	}
	if p := g2.page(t, browser); p.OK || p.Health != body || p.Master != "none" {
		t.Fatalf("page %+v while /healthz says %q: want red, the same reason, no master named", p, body)
	}
	out, err := g2.cli("status")
	if err != nil {
		t.Fatal(err)
	}
	if m, s := statusLine(out, "master"), statusLine(out, "serving"); m != "none reachable" || !strings.Contains(s, body) {
		t.Fatalf("tandem status says master %q, serving %q while /healthz says %q:\n%s", m, s, body, out)
	}

	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := g2.cli("promote")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("promote: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // retrying a refused command, not waiting for state
	}
	promoted := time.Now()
	waitHealthz(t, g2, 200, time.Second)
	t.Logf("200 %v after promote returned", time.Since(promoted).Round(time.Millisecond))
	testutil.WaitFor(t, time.Second, "gw-2 naming itself master", func() bool {
		out, err = g2.cli("status")
		return err == nil && strings.HasPrefix(statusLine(out, "master"), "gw-2 ") && statusLine(out, "serving") == "publishes and subscribers"
	}, func() string { return out })
	if p := g2.page(t, browser); !p.OK || p.Health != "serving" || p.Master != "gw-2" {
		t.Fatalf("the promoted master's page %+v", p)
	}
	g2.stop()
}

// A master of three cut off from the others steps down; from then on
// its /healthz is 503 with the reason, and 200 again once it is a slave of
// the new master.
func TestThreeGatewaysCutOffMasterHealthz(t *testing.T) {
	// On a network of its own, mostly waiting: beside the other such tests
	// (make test's time).
	t.Parallel()
	nt := netns.New(t, 3)
	g1, g2, g3 := startThree(t, nt)
	g2.join(g1)
	g3.join(g1)
	waitShape(t, g1, 2, 0, 20*time.Second)
	waitHealthz(t, g1, 200, 5*time.Second)
	nt.Partition([]*netns.Host{nt.Hosts[0]}, []*netns.Host{nt.Hosts[1], nt.Hosts[2]})
	master := waitMaster(t, time.Now().Add(10*time.Second), g2, g3)
	waitRoleNot(t, g1, "master", 5*time.Second)
	// The gate that answers /healthz takes the step-down a moment after
	// the role shows it (4 ms apart in a loaded run: "role changed", then
	// "not taking publishes"): 503 first, then it must hold.
	waitHealthz(t, g1, 503, 5*time.Second)
	// Once it stepped down, and for as long as it is cut off.
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); {
		if code, body := g1.healthzBody(); code != 503 || !strings.Contains(body, "no master reachable") {
			t.Fatalf("the cut-off master, stepped down: /healthz %d %q", code, body)
		}
		time.Sleep(100 * time.Millisecond) // sampling a state that must hold, not waiting for one
	}
	if s := g1.status(); s == nil || s.Leader != nil {
		t.Fatalf("the cut-off master names a master: %+v", s)
	}
	nt.HealAll()
	waitRole(t, g1, "slave", master.name, 20*time.Second)
	waitHealthz(t, g1, 200, 5*time.Second)
	for _, g := range []*gw{g1, g2, g3} {
		g.stop()
	}
}
