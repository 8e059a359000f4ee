package admin

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/tandem-edge/tandem/config"
)

// The admin API's guard. The API can make a gateway discard its log and
// join another cluster, and a browser on the gateway (or on a field
// engineer's laptop running tandem) will send requests to loopback for any
// web page it shows. So being on loopback proves nothing; a request is
// trusted only when it
//   - names this listener in its Host header (a DNS-rebinding page names
//     its own domain there),
//   - comes from no other origin (Origin absent or equal to Host,
//     Sec-Fetch-Site not cross-site or same-site),
//   - is JSON (an HTML form cannot send application/json without CORS,
//     which this API never grants), and
//   - carries the API token, which only someone who can read the data dir
//     (or http.token_file) has.
// Read-only endpoints (status, metrics, the page) check Host only, so a
// browser on the gateway keeps showing the status page.

// apiTokenFile is the name of the token the daemon creates in its data dir
// when http.token_file is not set.
const apiTokenFile = "http-token"

// Bounds of the HTTP server: a handful of CLI calls, a scraper and a
// browser are its real load, so these only stop a slow or flooding client
// from holding memory and goroutines. The connection budget is in
// connlimit.go.
const (
	httpMaxHeaderBytes = 16 << 10
	httpReadTimeout    = 30 * time.Second
	// httpWriteTimeout must exceed the longest handler: pair join browses
	// up to maxPairBrowse and then joins (up to 60 s).
	httpWriteTimeout = 2 * time.Minute
	// apiMaxBody bounds a request body: every request is a small object.
	apiMaxBody = 64 << 10
)

// apiGuard holds what the checks compare against.
type apiGuard struct {
	// tokenFile is read on each mutating request, so an operator can
	// rotate it without a restart.
	tokenFile string
	// hosts are host names (lower case) accepted in Host besides loopback
	// and the address a connection arrived at.
	hosts map[string]bool
}

// newAPIGuard finds or makes the API token and lists the host names the
// listener answers to. A missing http.token_file is a configuration error.
func newAPIGuard(c *config.Config, log *slog.Logger) (*apiGuard, error) {
	g := &apiGuard{tokenFile: TokenFile(c), hosts: map[string]bool{"localhost": true}}
	if c.HTTP.TokenFile == "" {
		if err := ensureToken(g.tokenFile); err != nil {
			return nil, fmt.Errorf("http token: %w", err)
		}
	} else if _, err := ReadToken(g.tokenFile); err != nil {
		return nil, config.UsageError{Err: fmt.Errorf("http.token_file: %w", err)}
	}
	WarnLooseMode(log, "http token file", g.tokenFile)
	if host, _, err := net.SplitHostPort(c.HTTP.Listen); err == nil && host != "" {
		// A wildcard is no name a request should use: browsers take
		// 0.0.0.0 for loopback, so it would only widen what pages reach.
		if ip := net.ParseIP(host); ip == nil || !ip.IsUnspecified() {
			g.hosts[normHost(host)] = true
		}
	}
	for _, h := range c.HTTP.AllowedHosts {
		g.hosts[normHost(h)] = true
	}
	if hn, err := os.Hostname(); err == nil && hn != "" {
		// The gateway's own name (and its mDNS name) is not a name a
		// rebinding page can own.
		g.hosts[normHost(hn)] = true
		g.hosts[normHost(hn)+".local"] = true
	}
	return g, nil
}

// ensureToken creates path with a fresh random token unless it exists.
func ensureToken(path string) error {
	if _, err := ReadToken(path); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return err
	}
	// Written aside, synced and renamed, the directory synced after: a CLI
	// never reads half a token, and a power cut leaves the old state or
	// the whole new token, never an empty file under the name (which
	// ReadToken refuses, so the daemon could not start).
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.WriteString(hex.EncodeToString(b) + "\n")
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// WarnLooseMode logs a warning when a secret file (a token, the users'
// hashes, a key) can be read or changed by other users: what is in it then
// gives them access too. A group that is the daemon's own is fine: the
// packaged way is root:tandem 0640.
func WarnLooseMode(log *slog.Logger, what, path string) {
	if path == "" || log == nil {
		return
	}
	fi, err := os.Stat(path)
	if err != nil {
		return
	}
	perm := fi.Mode().Perm()
	loose := perm&0o007 != 0 // others
	if perm&0o070 != 0 {
		st, ok := fi.Sys().(*syscall.Stat_t)
		loose = loose || !ok || int(st.Gid) != os.Getgid() || perm&0o020 != 0
	}
	if loose {
		log.Warn(what+" is open to other users: chmod 600 it, or 640 with the daemon's own group", "file", path, "mode", fmt.Sprintf("%04o", perm))
	}
}

// normHost lower-cases a host name and drops brackets and a final dot.
func normHost(h string) string {
	h = strings.TrimSuffix(strings.Trim(strings.ToLower(h), "[]"), ".")
	if i := strings.IndexByte(h, '%'); i >= 0 { // IPv6 zone
		h = h[:i]
	}
	return h
}

// hostOK reports whether r's Host names this listener: loopback, the
// address the connection arrived at, or a configured name. The port is not
// checked: through `ssh -L 9000:localhost:7880` a browser says localhost:9000.
func (g *apiGuard) hostOK(r *http.Request) bool {
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = normHost(host)
	if host == "" {
		return false
	}
	if g.hosts[host] {
		return true
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return false
	}
	if ip.IsLoopback() {
		return true
	}
	// An address literal of this machine is not a rebinding name: the
	// page that sends it has that address as its origin, which the
	// Origin check handles for mutating requests.
	if la, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr); ok {
		if ta, ok := la.(*net.TCPAddr); ok && ta.IP.Equal(ip) {
			return true
		}
	}
	return false
}

// originOK reports whether r comes from no other web origin.
func originOK(r *http.Request) bool {
	switch r.Header.Get("Sec-Fetch-Site") {
	case "", "same-origin", "none":
	default:
		return false
	}
	o := r.Header.Get("Origin")
	if o == "" {
		return true
	}
	u, err := url.Parse(o)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") {
		return false // "null" included: sandboxed pages and file:// send it
	}
	return strings.EqualFold(u.Host, r.Host)
}

// jsonBody reports whether r says its body is JSON.
func jsonBody(r *http.Request) bool {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return err == nil && mt == "application/json"
}

// tokenOK reports whether r carries the API token.
func (g *apiGuard) tokenOK(r *http.Request) bool {
	want, err := ReadToken(g.tokenFile)
	if err != nil {
		return false
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(strings.TrimSpace(got)), []byte(want)) == 1
}

// readOnly wraps the whole mux: every request must name this listener.
func (g *apiGuard) readOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !g.hostOK(r) {
			http.Error(w, "Host "+r.Host+" is not this gateway's (add it to http.allowed_hosts)", http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// mutating guards an endpoint that changes the cluster: no other origin,
// JSON, and the token. Host is checked by readOnly, which wraps the mux.
func (g *apiGuard) mutating(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		switch {
		case !g.hostOK(r):
			WriteError(w, http.StatusForbidden, fmt.Errorf("Host %s is not this gateway's (add it to http.allowed_hosts)", r.Host))
		case !originOK(r):
			WriteError(w, http.StatusForbidden, errors.New("cross-origin requests are refused"))
		case !jsonBody(r):
			WriteError(w, http.StatusUnsupportedMediaType, errors.New("send Content-Type: application/json"))
		case !g.tokenOK(r):
			WriteError(w, http.StatusUnauthorized, fmt.Errorf("a valid bearer token is required (the daemon's %s; the CLI reads it with --config, --data or --token-file)", g.tokenFile))
		default:
			r.Body = http.MaxBytesReader(w, r.Body, apiMaxBody)
			h(w, r)
		}
	}
}

// TokenFile is where the daemon run with c keeps its API token:
// http.token_file, or the data dir's http-token.
func TokenFile(c *config.Config) string {
	if c.HTTP.TokenFile != "" {
		return c.HTTP.TokenFile
	}
	return filepath.Join(c.Node.DataDir, apiTokenFile)
}

// ReadToken reads a token file: its first line, trimmed. The CLI reads
// the daemon's token with it, the guard a configured http.token_file.
func ReadToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	tok, _, _ := strings.Cut(string(b), "\n")
	tok = strings.TrimSpace(tok)
	if tok == "" {
		return "", fmt.Errorf("%s: empty token", path)
	}
	return tok, nil
}
