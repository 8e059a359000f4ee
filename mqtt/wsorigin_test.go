package mqtt

import (
	"bufio"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// upgrade sends a raw WebSocket upgrade request for Host host with the
// given Origin ("" for none) and returns the status and body of the
// answer.
func upgrade(t *testing.T, addr, host, origin string) (int, string) {
	t.Helper()
	c := dialTCP(t, addr)
	req := "GET /mqtt HTTP/1.1\r\nHost: " + host + "\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n" +
		"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: mqtt\r\n"
	if origin != "" {
		req += "Origin: " + origin + "\r\n"
	}
	if _, err := io.WriteString(c, req+"\r\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("origin %q: %v", origin, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return resp.StatusCode, ""
	}
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// Browser dashboards connect by default, safely (issue 35): on a listener
// that requires credentials any page may open a WebSocket, since a
// hostile page cannot log in; on an anonymous one only pages of the
// listener's host (any port), of loopback and of origins. A refusal is a
// 403 saying why, counted as ws_origin. The listener's default used to
// refuse a dashboard on another port and every file:// page.
func TestWebSocketOriginPolicy(t *testing.T) {
	users, err := ParseUsers(strings.NewReader(hashLine(t, "alice", "pw")+"\n"), "users")
	if err != nil {
		t.Fatal(err)
	}
	type tc struct {
		host, origin string
		admitted     bool
	}
	for _, lt := range []struct {
		name    string
		mutate  func(*Config)
		origins []string
		cases   []tc
	}{
		{"credentials required", func(c *Config) { c.Users, c.AllowAnonymous = users, false }, nil, []tc{
			{"127.0.0.1:21884", "http://127.0.0.1:8000", true},
			{"127.0.0.1:21884", "null", true},
			{"gw.example.net:8080", "https://elsewhere.example.org", true},
			{"127.0.0.1:21884", "", true},
		}},
		{"anonymous", nil, nil, []tc{
			{"127.0.0.1:21884", "http://127.0.0.1:8000", true},
			{"198.51.100.7:8080", "http://198.51.100.7:8000", true},
			{"[2001:db8::7]:8080", "http://[2001:db8::7]", true},
			// A name: its DNS may be rebound to the gateway.
			{"gw.example.net:8080", "http://gw.example.net", false},
			{"gw.example.net:8080", "http://localhost:3000", true},
			{"gw.example.net:8080", "http://[::1]:3000", true},
			{"127.0.0.1:21884", "", true},
			{"127.0.0.1:21884", "null", false},
			{"127.0.0.1:21884", "http://evil.example", false},
			{"gw.example.net:8080", "http://gw.example.net.evil.example", false},
			{"127.0.0.1:21884", "not a url", false},
		}},
		{"anonymous with origins", nil, []string{"dash.example.com", "*.corp.example", "kiosk.example:8443", "null"}, []tc{
			{"gw:8080", "http://dash.example.com:8000", true},
			{"gw:8080", "https://dash.example.com", true},
			{"gw:8080", "https://a.corp.example", true},
			{"gw:8080", "https://kiosk.example:8443", true},
			{"gw:8080", "null", true},
			{"gw:8080", "https://kiosk.example", false},
			{"gw:8080", "https://corp.example", false},
			{"gw:8080", "https://evil.example", false},
		}},
		{"credentials required with origins", func(c *Config) { c.Users, c.AllowAnonymous = users, false }, []string{"dash.example.com"}, []tc{
			{"gw:8080", "http://dash.example.com:8000", true},
			{"198.51.100.7:8080", "http://198.51.100.7:3000", true},
			{"gw:8080", "https://evil.example", false},
			{"gw:8080", "null", false},
		}},
	} {
		t.Run(lt.name, func(t *testing.T) {
			obs := &reasonObserver{}
			s, _ := testServer(t, nil, func(c *Config) {
				c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0", OriginPatterns: lt.origins}
				c.Observer = obs
				if lt.mutate != nil {
					lt.mutate(c)
				}
			})
			refused := 0
			for _, c := range lt.cases {
				status, body := upgrade(t, s.WSAddr(), c.host, c.origin)
				switch {
				case c.admitted && status != http.StatusSwitchingProtocols:
					t.Errorf("Host %s, Origin %q: %d %q, want the upgrade", c.host, c.origin, status, body)
				case !c.admitted && (status != http.StatusForbidden || !strings.Contains(body, "Origin")):
					t.Errorf("Host %s, Origin %q: %d %q, want 403 saying why", c.host, c.origin, status, body)
				}
				if !c.admitted {
					refused++
				}
			}
			testutil.WaitFor(t, 5*time.Second, "each refusal counted as ws_origin", func() bool { return obs.count(refusedWSOrigin) == refused }, obs.String)
		})
	}
}

// A malformed origins entry stops the start with its name.
func TestWebSocketOriginsEntryMustBeAHostPattern(t *testing.T) {
	for _, bad := range []string{"dash[.example", "user@host", ""} {
		if _, err := newOriginPolicy([]string{bad}); err == nil {
			t.Errorf("origins entry %q accepted", bad)
		}
	}
}
