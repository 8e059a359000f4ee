package daemon

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
)

// rawAPI sends one request to d's HTTP listener exactly as given: the
// Host, headers and body an attacker's page or a careless client would
// send. It returns the status and the body.
func rawAPI(t *testing.T, d *Daemon, method, path, host string, hdr map[string]string, body string) (int, string) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, "http://"+d.HTTPAddr()+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestAdminAPIRefusesCrossSiteRebindingAndTokenless tries every mutating
// endpoint with each of the requests the security review sent (a
// cross-site text/plain form, a rebinding Host, no token, a non-JSON body)
// and a few neighbours of them: each is refused before the handler runs,
// and the gateway is unchanged afterwards.
func TestAdminAPIRefusesCrossSiteRebindingAndTokenless(t *testing.T) {
	d := clusterGateway(t, "gw-1", nil)
	if len(d.http.MutatingPaths()) < 6 {
		t.Fatalf("mutating routes %v: want invite, join, remove, promote, pair open, pair join", d.http.MutatingPaths())
	}
	tok := apiToken(t, d)
	good := func() map[string]string {
		return map[string]string{"Content-Type": "application/json", "Authorization": "Bearer " + tok}
	}
	with := func(k, v string) map[string]string {
		h := good()
		if v == "" {
			delete(h, k)
		} else {
			h[k] = v
		}
		return h
	}
	// The review's body: an attacker's join token, mode discard, and the
	// "=" an HTML text/plain form appends.
	const formBody = `{"token":"tdm1.attacker","mode":"discard","x":"="}`
	cases := []struct {
		name string
		host string
		hdr  map[string]string
		body string
		want int
	}{
		{"cross-site form post", "", map[string]string{"Content-Type": "text/plain", "Origin": "null"}, formBody, http.StatusForbidden},
		{"Origin null, otherwise valid", "", with("Origin", "null"), `{}`, http.StatusForbidden},
		{"foreign Origin", "", with("Origin", "http://evil.example"), `{}`, http.StatusForbidden},
		{"Sec-Fetch-Site cross-site", "", with("Sec-Fetch-Site", "cross-site"), `{}`, http.StatusForbidden},
		{"rebinding Host", "evil.example:7880", good(), `{}`, http.StatusForbidden},
		{"rebinding Host with its own Origin", "evil.example:7880", with("Origin", "http://evil.example:7880"), `{}`, http.StatusForbidden},
		{"no token", "", with("Authorization", ""), `{}`, http.StatusUnauthorized},
		{"wrong token", "", with("Authorization", "Bearer 00"), `{}`, http.StatusUnauthorized},
		{"text/plain", "", with("Content-Type", "text/plain"), `{}`, http.StatusUnsupportedMediaType},
		{"form urlencoded", "", with("Content-Type", "application/x-www-form-urlencoded"), `{}`, http.StatusUnsupportedMediaType},
		{"no content type", "", with("Content-Type", ""), `{}`, http.StatusUnsupportedMediaType},
		{"empty body", "", good(), ``, http.StatusBadRequest},
		{"unknown field", "", good(), `{"x":"="}`, http.StatusBadRequest},
		{"two values", "", good(), `{} {}`, http.StatusBadRequest},
	}
	for _, path := range d.http.MutatingPaths() {
		for _, c := range cases {
			if code, body := rawAPI(t, d, http.MethodPost, path, c.host, c.hdr, c.body); code != c.want {
				t.Errorf("%s %s: %d %s, want %d", path, c.name, code, strings.TrimSpace(body), c.want)
			}
		}
	}
	// Still alone, no pairing open, no invite issued.
	s := statusOfGW(t, d)
	if len(s.Members) > 1 || s.Pairing.Open {
		t.Fatalf("the gateway changed: members %+v, pairing %+v", s.Members, s.Pairing)
	}
	n := d.gw.Internals().PendingInvites()
	if n != 0 {
		t.Fatalf("%d invites issued", n)
	}

	// The same-origin request the CLI sends, and one a page served by the
	// gateway itself would send, are taken.
	for _, h := range []map[string]string{good(), with("Origin", "http://"+d.HTTPAddr()), with("Sec-Fetch-Site", "same-origin")} {
		if code, body := rawAPI(t, d, http.MethodPost, "/v1/cluster/invite", "", h, `{}`); code != http.StatusOK {
			t.Fatalf("invite %v: %d %s", h, code, body)
		}
	}
}

// TestReadOnlyEndpointsCheckHostOnly: status, metrics, healthz and the
// page answer a browser on the gateway (no token) under any of the
// listener's own names, and refuse a rebinding Host.
func TestReadOnlyEndpointsCheckHostOnly(t *testing.T) {
	d := clusterGateway(t, "gw-1", func(c *config.Config) { c.HTTP.AllowedHosts = []string{"GW-1.example.net"} })
	_, port, _ := strings.Cut(d.HTTPAddr(), ":")
	for _, path := range []string{"/", "/v1/status", "/metrics", "/healthz"} {
		for _, host := range []string{"", "localhost:" + port, "LOCALHOST", "127.0.0.1:" + port, "[::1]:" + port, "localhost:9000", "gw-1.example.net:" + port} {
			if code, body := rawAPI(t, d, http.MethodGet, path, host, map[string]string{"Sec-Fetch-Site": "none"}, ""); code != http.StatusOK {
				t.Errorf("GET %s Host %q: %d %s", path, host, code, body)
			}
		}
		for _, host := range []string{"evil.example:" + port, "evil.example", "127.0.0.1.evil.example", "localhost.evil.example", "0.0.0.0:" + port, "[::]:" + port} {
			if code, _ := rawAPI(t, d, http.MethodGet, path, host, nil, ""); code != http.StatusForbidden {
				t.Errorf("GET %s Host %q: %d, want 403", path, host, code)
			}
		}
	}
}

// TestAPITokenWrittenOnceAndFoundByTheCLI: the daemon writes its token
// into the data dir (0600) at first start and keeps it across restarts;
// the CLI finds it with no flag but --http for a daemon started in the
// current directory without flags, and with --config.
func TestAPITokenWrittenOnceAndFoundByTheCLI(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	d := clusterGateway(t, "gw-1", func(c *config.Config) { c.Node.DataDir = config.DefaultConfig().Node.DataDir })
	path := filepath.Join(dir, config.DefaultConfig().Node.DataDir, "http-token")
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("token file mode %04o, want 0600", fi.Mode().Perm())
	}
	tok := apiToken(t, d)
	if code, out, errOut := runMain(t, "pair", "open", "--http", d.HTTPAddr()); code != ExitOK || out == "" {
		t.Fatalf("pair open with the default data dir: exit %d: %s%s", code, out, errOut)
	}
	d.Stop()

	// The same token after a restart, and found through --config.
	cfgFile := filepath.Join(dir, "tandem.yaml")
	writeFile(t, cfgFile, "node:\n  name: gw-1\n  data_dir: "+config.DefaultConfig().Node.DataDir+"\nhttp:\n  listen: 127.0.0.1:0\n")
	d2 := clusterGateway(t, "gw-1", func(c *config.Config) { c.Node.DataDir = config.DefaultConfig().Node.DataDir })
	if got := apiToken(t, d2); got != tok {
		t.Fatalf("token changed on restart: %q → %q", tok, got)
	}
	if code, out, errOut := runMain(t, "cluster", "invite", "--loopback", "--http", d2.HTTPAddr(), "--config", cfgFile); code != ExitOK || !strings.HasPrefix(out, "tandem1.") {
		t.Fatalf("invite through --config: exit %d %q %s", code, out, errOut)
	}
	// A wrong token file says what to do.
	bad := writeFile(t, filepath.Join(dir, "bad-token"), "nope\n")
	code, _, errOut := runMain(t, "cluster", "invite", "--http", d2.HTTPAddr(), "--token-file", bad)
	if code == ExitOK || !strings.Contains(errOut, "token") {
		t.Fatalf("wrong token: exit %d: %s", code, errOut)
	}
	// status needs no token.
	if code, _, errOut := runMain(t, "status", "--http", d2.HTTPAddr(), "--token-file", bad); code != ExitOK {
		t.Fatalf("status: exit %d: %s", code, errOut)
	}
}

// TestConfiguredTokenFile: with http.token_file the daemon uses that token
// (and writes none of its own), warns that a world-readable one (and such a
// users file) is loose, and refuses to start without the file.
func TestConfiguredTokenFile(t *testing.T) {
	dir := t.TempDir()
	tf := filepath.Join(dir, "api-token")
	if err := os.WriteFile(tf, []byte("s3cret-token\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	users := usersFile(t, filepath.Join(dir, "users"), "u", "p")
	if err := os.Chmod(users, 0o604); err != nil {
		t.Fatal(err)
	}
	d, logs := startGateway(t, func(c *config.Config) { c.HTTP.TokenFile = tf; c.MQTT.UsersFile = users })
	for _, what := range []string{"http token file is open to other users", "mqtt.users_file is open to other users"} {
		if !strings.Contains(logs.String(), what) {
			t.Fatalf("no warning %q:\n%s", what, logs)
		}
	}
	// The daemon's own group may read it: no warning for a 0640 file.
	if err := os.Chmod(tf, 0o640); err != nil {
		t.Fatal(err)
	}
	_, logs2 := startGateway(t, func(c *config.Config) { c.HTTP.TokenFile = tf })
	if strings.Contains(logs2.String(), "open to other users") {
		t.Fatalf("warned of a 0640 file of the daemon's own group:\n%s", logs2)
	}
	if _, err := os.Stat(filepath.Join(d.cfg.Node.DataDir, "http-token")); err == nil {
		t.Fatal("a data-dir token was written although http.token_file is set")
	}
	b, _ := json.Marshal(admin.InviteRequest{})
	code, body := rawAPI(t, d, http.MethodPost, "/v1/cluster/invite", "", map[string]string{"Content-Type": "application/json", "Authorization": "Bearer s3cret-token"}, string(bytes.TrimSpace(b)))
	if code != http.StatusOK {
		t.Fatalf("invite with the configured token: %d %s", code, body)
	}

	cfg := config.DefaultConfig()
	cfg.Node.DataDir = t.TempDir()
	cfg.MQTT.Listen, cfg.HTTP.Listen, cfg.Peer.Listen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.HTTP.TokenFile = filepath.Join(dir, "missing")
	d2, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.Start(t.Context()); err == nil || !strings.Contains(err.Error(), "token_file") {
		d2.Stop()
		t.Fatalf("start with a missing token file: %v", err)
	}
}
