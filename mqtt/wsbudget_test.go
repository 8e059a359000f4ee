package mqtt

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// reasonObserver records the reasons of the refusals the server reports.
type reasonObserver struct {
	nopObserver
	mu      sync.Mutex
	reasons []string
}

func (o *reasonObserver) Refused(reason string) {
	o.mu.Lock()
	o.reasons = append(o.reasons, reason)
	o.mu.Unlock()
}

func (o *reasonObserver) count(reason string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, r := range o.reasons {
		if r == reason {
			n++
		}
	}
	return n
}

func (o *reasonObserver) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return fmt.Sprint("refusals: ", o.reasons)
}

// dialTCP opens a plain socket to addr, closed when the test ends.
func dialTCP(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer reports whether the server closed c within d: a read
// ends in EOF or a reset, not in the test's own deadline. What the server
// sent before is read and dropped.
func closedByServer(c net.Conn, d time.Duration) bool {
	_ = c.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

// A plain GET on the WebSocket port, or an upgrade the listener refuses,
// gets its answer with Connection: close and the socket is closed: the
// port keeps no HTTP connection alive, so idle browsers and scanners hold
// no sockets after their one request, and the socket count falls back.
func TestWebSocketPlainGETIsClosed(t *testing.T) {
	obs := &reasonObserver{}
	s, _ := testServer(t, nil, func(c *Config) {
		c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0"}
		c.Observer = obs
	})
	for _, tc := range []struct {
		name, req string
		status    int
	}{
		{"plain GET", "GET / HTTP/1.1\r\nHost: gw\r\n\r\n", http.StatusUpgradeRequired},
		{"keep-alive GET", "GET /mqtt HTTP/1.1\r\nHost: gw\r\nConnection: keep-alive\r\n\r\n", http.StatusUpgradeRequired},
		{"another origin", "GET /mqtt HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n" +
			"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: mqtt\r\n" +
			"Origin: http://evil.example\r\n\r\n", http.StatusForbidden},
		{"no key", "GET /mqtt HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\r\n", http.StatusBadRequest},
	} {
		c := dialTCP(t, s.WSAddr())
		// A second request right behind the first: a kept-alive socket
		// would answer it too.
		if _, err := io.WriteString(c, tc.req+"GET / HTTP/1.1\r\nHost: gw\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		// ReadResponse takes "Connection: close" out of the header into
		// Close.
		if resp.StatusCode != tc.status || !resp.Close {
			t.Errorf("%s: %s, close %v: want %d and Connection: close", tc.name, resp.Status, resp.Close, tc.status)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if _, err := http.ReadResponse(br, nil); err == nil {
			t.Errorf("%s: the second request on the socket was answered too", tc.name)
		}
		if !closedByServer(c, 5*time.Second) {
			t.Errorf("%s: the socket is still open 5 s after the answer", tc.name)
		}
	}
	testutil.WaitFor(t, 5*time.Second, "the refused sockets to leave the socket count", func() bool { return s.openConns.Load() == 0 })
	testutil.WaitFor(t, 5*time.Second, "every refusal counted", func() bool { return obs.count(refusedWSUpgrade) == 3 && obs.count(refusedWSOrigin) == 1 }, obs.String)
}

// A socket on the WebSocket port has Limits.ConnectTimeout from accept to
// become a WebSocket: one that says nothing, or sends half a request, is
// closed and counted; one that upgraded in time keeps its connection past
// that moment.
func TestWebSocketIdleHandshakeTimesOut(t *testing.T) {
	obs := &reasonObserver{}
	const timeout = 300 * time.Millisecond
	s, _ := testServer(t, nil, func(c *Config) {
		c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0"}
		c.Observer = obs
		c.Limits.ConnectTimeout = timeout
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	silent := dialTCP(t, s.WSAddr())
	half := dialTCP(t, s.WSAddr())
	if _, err := io.WriteString(half, "GET /mqtt HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\n"); err != nil {
		t.Fatal(err)
	}
	wc, _, err := websocket.Dial(ctx, "ws://"+s.WSAddr()+"/mqtt", &websocket.DialOptions{Subprotocols: []string{"mqtt"}})
	if err != nil {
		t.Fatal(err)
	}
	nc := websocket.NetConn(context.Background(), wc, websocket.MessageBinary)
	t.Cleanup(func() { nc.Close() })
	dev := &raw{t: t, c: nc, v: 5, rd: &bytesReader{nc}}
	if ack := dev.connect("dash", true, nil); ack.ReasonCode != 0 {
		t.Fatalf("CONNACK %#x", ack.ReasonCode)
	}
	start := time.Now()
	for name, c := range map[string]net.Conn{"silent": silent, "half a request": half} {
		if !closedByServer(c, 10*timeout) {
			t.Fatalf("%s socket still open %v after its accept (connect timeout %v)", name, time.Since(start), timeout)
		}
	}
	testutil.WaitFor(t, 5*time.Second, "both timeouts counted", func() bool { return obs.count(refusedWSTimeout) == 2 }, obs.String)
	// The handshake deadline has passed for the upgraded socket too: it
	// must not have been left on it.
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	dev.expect(packets.Pingresp)
	if s.openConns.Load() != 1 {
		t.Fatalf("%d sockets counted, want 1: the WebSocket client's", s.openConns.Load())
	}
}

// Sockets on the WebSocket port count against the server's socket cap
// from accept, before any upgrade or CONNECT: with the cap held by idle
// WebSocket sockets, one more socket on either port is closed at accept,
// and once they are gone a device connects again.
func TestWebSocketConnectionsCountInSocketCap(t *testing.T) {
	obs := &reasonObserver{}
	s, _ := testServer(t, nil, func(c *Config) {
		c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0"}
		c.Observer = obs
		c.Limits.MaxClients = 1
	})
	max := int(s.maxOpenConns)
	idle := make([]net.Conn, max)
	for i := range idle {
		idle[i] = dialTCP(t, s.WSAddr())
	}
	testutil.WaitFor(t, 5*time.Second, "every idle WebSocket socket counted", func() bool { return s.openConns.Load() == int64(max) })
	if !closedByServer(dialTCP(t, s.WSAddr()), 5*time.Second) {
		t.Fatal("a WebSocket socket over the cap was kept")
	}
	if !closedByServer(dialTCP(t, s.Addr()), 5*time.Second) {
		t.Fatal("an MQTT socket over the cap was kept")
	}
	// The socket is closed before its refusal is counted.
	testutil.WaitFor(t, 5*time.Second, "both refusals counted", func() bool { return obs.count(refusedBusy) == 2 }, obs.String)
	for _, c := range idle {
		c.Close()
	}
	testutil.WaitFor(t, 5*time.Second, "the closed sockets to leave the count", func() bool { return s.openConns.Load() == 0 })
	if ack := dialRaw(t, s.Addr(), 5).connect("device", true, nil); ack.ReasonCode != 0 {
		t.Fatalf("CONNACK %#x once the sockets closed", ack.ReasonCode)
	}
}

// Over wss:// the same budget holds under TLS: a socket that never
// starts its TLS handshake is closed at the connect timeout, and one that
// does upgrades and connects as over ws://.
func TestWebSocketTLSHandshakeTimesOut(t *testing.T) {
	obs := &reasonObserver{}
	cert, key := selfSigned(t, t.TempDir())
	s, _ := testServer(t, nil, func(c *Config) {
		c.TLS = &TLSConfig{Listen: "127.0.0.1:0", CertFile: cert, KeyFile: key}
		c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0", TLS: true}
		c.Observer = obs
		// Long enough for the other socket's TLS handshake, upgrade and
		// CONNECT on a loaded host (300 ms was not, at a load average
		// of 11 on two cores).
		c.Limits.ConnectTimeout = 2 * time.Second
	})
	silent := dialTCP(t, s.WSAddr())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	wc, _, err := websocket.Dial(ctx, "wss://"+s.WSAddr()+"/mqtt", &websocket.DialOptions{Subprotocols: []string{"mqtt"}, HTTPClient: hc})
	if err != nil {
		t.Fatal(err)
	}
	nc := websocket.NetConn(context.Background(), wc, websocket.MessageBinary)
	t.Cleanup(func() { nc.Close() })
	dev := &raw{t: t, c: nc, v: 4, rd: &bytesReader{nc}}
	if ack := dev.connect("dash", true, nil); ack.ReasonCode != 0 {
		t.Fatalf("CONNACK %#x over wss", ack.ReasonCode)
	}
	if !closedByServer(silent, 5*time.Second) {
		t.Fatal("a socket that never started its TLS handshake is still open")
	}
	testutil.WaitFor(t, 5*time.Second, "the timeout counted", func() bool { return obs.count(refusedWSTimeout) == 1 }, obs.String)
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	dev.expect(packets.Pingresp)
}
