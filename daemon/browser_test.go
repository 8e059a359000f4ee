package daemon

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// mqttJS returns the path of MQTT.js's browser bundle (mqtt.min.js),
// installed with npm into the user's cache once and reused. Without npm,
// or when the registry cannot be reached, the test skips saying so;
// under CI=true it fails.
func mqttJS(t *testing.T) string {
	t.Helper()
	miss := func(format string, args ...any) {
		t.Helper()
		if os.Getenv("CI") == "true" {
			t.Fatalf(format, args...)
		}
		t.Skipf(format, args...)
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "tandem-tests", "mqttjs-5")
	bundle := filepath.Join(dir, "node_modules", "mqtt", "dist", "mqtt.min.js")
	if _, err := os.Stat(bundle); err == nil {
		return bundle
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		miss("npm not found (apt-get install npm): MQTT.js is not run in a browser")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", dir, "mqtt@5")
	if out, err := cmd.CombinedOutput(); err != nil {
		miss("npm install mqtt@5 failed (%v): MQTT.js is not run in a browser\n%s", err, out)
	}
	if _, err := os.Stat(bundle); err != nil {
		miss("npm install mqtt@5 left no %s", bundle)
	}
	return bundle
}

// dashPage is a dashboard page: MQTT.js connects to the gateway's
// WebSocket listener, subscribes to its own topic, publishes to it and
// reports what came back (or the error) to report, as an image request so
// that a file:// page can report too.
const dashPage = `<!doctype html><html><head><meta charset="utf-8"><script src="%s"></script></head><body><script>
const report = (r) => { new Image().src = %q + "?case=%s&result=" + encodeURIComponent(r); };
let done = false;
const once = (r) => { if (!done) { done = true; report(r); } };
const user = %q, password = %q;
const c = mqtt.connect(%q, {protocolVersion: 5, clientId: "page-%s", username: user || undefined,
  password: password || undefined, reconnectPeriod: 0, connectTimeout: 5000});
c.on("connect", () => c.subscribe("page/%s", {qos: 1}, (err) => {
  if (err) { once("subscribe failed: " + err.message); return; }
  c.publish("page/%s", "hello from %s", {qos: 1});
}));
c.on("message", (topic, msg) => { once("ok " + msg.toString()); c.end(); });
c.on("error", (e) => once("error " + e.message));
c.on("close", () => once("closed without connecting"));
</script></body></html>`

// pageReports collects what the pages report, by case.
type pageReports struct {
	mu  sync.Mutex
	got map[string]string
}

func (p *pageReports) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	if p.got == nil {
		p.got = map[string]string{}
	}
	p.got[r.URL.Query().Get("case")] = r.URL.Query().Get("result")
	p.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (p *pageReports) result(name string) (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r, ok := p.got[name]
	return r, ok
}

// openInChromium has headless Chromium load url (with evil.example
// resolving to loopback) until the test ends or stop is called.
func openInChromium(t *testing.T, url string) (stop func()) {
	t.Helper()
	bin := chromium(t)
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, bin, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
		"--disable-dev-shm-usage", "--user-data-dir="+t.TempDir(), "--remote-debugging-port=0",
		"--host-resolver-rules=MAP evil.example 127.0.0.1", url)
	// Its own process group: the browser's helpers are stopped with it,
	// before the test removes their profile directory.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("chromium: %v", err)
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			_ = cmd.Wait()
		})
	}
	t.Cleanup(stop)
	return stop
}

// Browser dashboards connect by default, safely (issue 35), with MQTT.js
// 5 in headless Chromium: against a gateway that requires credentials, a
// page served on another port and a file:// page (Origin: null) log in,
// subscribe and get their own publish; against an anonymous gateway, a
// page of another site is refused and counted as ws_origin, while a
// loopback page on another port connects. The first two were refused by
// the default origin check.
func TestMQTTJSDashboardsInChromium(t *testing.T) {
	chromium(t)
	bundle := mqttJS(t)
	js, err := os.ReadFile(bundle)
	if err != nil {
		t.Fatal(err)
	}
	pages := t.TempDir()
	if err := os.WriteFile(filepath.Join(pages, "mqtt.min.js"), js, 0o644); err != nil {
		t.Fatal(err)
	}
	reports := &pageReports{}
	mux := http.NewServeMux()
	mux.Handle("/report", reports)
	mux.Handle("/", http.FileServer(http.Dir(pages)))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	web := "http://" + ln.Addr().String()
	_, webPort, _ := net.SplitHostPort(ln.Addr().String())

	dir := t.TempDir()
	locked := testGateway(t, filepath.Join(dir, "locked"), func(c *config.Config) {
		c.MQTT.WebSocket.Listen = "127.0.0.1:0"
		c.MQTT.UsersFile = usersFile(t, filepath.Join(dir, "users"), "dash", "pw-dash")
	})
	open := testGateway(t, filepath.Join(dir, "open"), func(c *config.Config) { c.MQTT.WebSocket.Listen = "127.0.0.1:0" })

	cases := []struct {
		name, url string
		gw        *Daemon
		user      string
		admitted  bool
	}{
		{"other-port", web + "/other-port.html", locked, "dash", true},
		{"file", "file://" + filepath.Join(pages, "file.html"), locked, "dash", true},
		{"hostile", "http://evil.example:" + webPort + "/hostile.html", open, "", false},
		{"loopback", web + "/loopback.html", open, "", true},
	}
	for _, tc := range cases {
		password := ""
		if tc.user != "" {
			password = "pw-" + tc.user
		}
		page := fmt.Sprintf(dashPage, "mqtt.min.js", web+"/report", tc.name, tc.user, password,
			"ws://"+tc.gw.MQTTWSAddr()+"/mqtt", tc.name, tc.name, tc.name, tc.name)
		if err := os.WriteFile(filepath.Join(pages, tc.name+".html"), []byte(page), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			stop := openInChromium(t, tc.url)
			var got string
			testutil.WaitFor(t, 30*time.Second, "the page to report", func() bool {
				var ok bool
				got, ok = reports.result(tc.name)
				return ok
			})
			stop()
			if want := "ok hello from " + tc.name; tc.admitted && got != want {
				t.Fatalf("the page reported %q, want %q", got, want)
			}
			if !tc.admitted && strings.HasPrefix(got, "ok") {
				t.Fatalf("the page of another site connected: %q", got)
			}
		})
	}
	if m := metric(scrape(t, open), "tandem_mqtt_refused_total", "reason", "ws_origin"); m == nil || m.GetCounter().GetValue() != 1 {
		t.Errorf("the anonymous gateway's ws_origin refusals: %v, want 1", m)
	}
	assertAnswersAndStops(t, open)
}
