package admin

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// fakeGateway answers the admin server with an empty, healthy gateway.
type fakeGateway struct{ cfg *config.Config }

func (g fakeGateway) Status(context.Context) (*Status, error)       { return &Status{Role: "master"}, nil }
func (g fakeGateway) Err() error                                    { return nil }
func (g fakeGateway) Live() *config.Config                          { return g.cfg }
func (g fakeGateway) Retained() int64                               { return 0 }
func (g fakeGateway) LeaderChanges(context.Context) (uint64, error) { return 0, nil }
func (g fakeGateway) Promotions() uint64                            { return 0 }
func (g fakeGateway) Depositions() uint64                           { return 0 }

// budgetServer starts an admin server on 127.0.0.1 with the HTTP settings
// mutate sets, judging only 127.0.0.1 loopback: 127.0.0.2 and up are the
// strangers of these tests.
func budgetServer(t *testing.T, log *slog.Logger, mutate func(*config.HTTPConfig)) *Server {
	t.Helper()
	cfg := config.DefaultConfig()
	cfg.Node.DataDir = t.TempDir()
	mutate(&cfg.HTTP)
	gw := fakeGateway{cfg}
	fv := NewFieldView(gw, cfg, log)
	s, err := NewServer(cfg, log, gw, fv)
	if err != nil {
		t.Fatal(err)
	}
	s.isLocal = func(a netip.Addr) bool { return a == netip.MustParseAddr("127.0.0.1") }
	if err := s.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Stop()
		fv.Stop()
	})
	return s
}

// client is one kept-alive HTTP connection from a source address.
type client struct {
	t  *testing.T
	c  net.Conn
	br *bufio.Reader
}

func dialFrom(t *testing.T, src, addr string) *client {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &client{t: t, c: c, br: bufio.NewReader(c)}
}

// get sends GET path on the connection and returns the answer's status,
// body and whether the server said it closes the connection.
func (cl *client) get(path string) (int, string, bool) {
	cl.t.Helper()
	if _, err := io.WriteString(cl.c, "GET "+path+" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
		cl.t.Fatal(err)
	}
	_ = cl.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(cl.br, nil)
	if err != nil {
		cl.t.Fatalf("GET %s from %s: %v", path, cl.c.LocalAddr(), err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Close
}

// closedByServer reports whether the server closed the connection within
// d, rather than the read running into the test's deadline.
func (cl *client) closedByServer(d time.Duration) bool {
	_ = cl.c.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, cl.br)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

func (s *Server) admitted() int {
	n, _ := s.lim.open()
	return n
}

// counterValue reads a counter of the field view's registry.
func counterValue(t *testing.T, fv *FieldView, name, reason string) float64 {
	t.Helper()
	mfs, err := fv.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{reason=%q}", name, reason)
	return 0
}

// Strangers holding every connection the API allows them, kept alive with
// requests, cannot keep `tandem status` on the gateway from answering: one
// address gets no more than its share, all of them no more than
// http.max_conns, and loopback has slots of its own past that (a few: a
// local hog is capped too). Refusals are a 503 that closes the
// connection, counted and logged with the address.
func TestHTTPKeepAliveHogsCannotStarveStatus(t *testing.T) {
	var lines logLines
	s := budgetServer(t, slog.New(&lines), func(h *config.HTTPConfig) {
		h.MaxConns, h.MaxConnsPerAddress, h.IdleTimeout = 4, 2, config.Duration(time.Minute)
	})
	var hogs []*client
	for _, src := range []string{"127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"} {
		h := dialFrom(t, src, s.Addr())
		if code, body, closing := h.get("/healthz"); code != http.StatusOK || closing {
			t.Fatalf("hog from %s: %d %q, closing %v: want 200, kept alive", src, code, body, closing)
		}
		hogs = append(hogs, h)
	}
	for _, tc := range []struct{ src, reason string }{
		{"127.0.0.2", refusedHTTPAddr},  // its two are open
		{"127.0.0.4", refusedHTTPTotal}, // all four are taken
	} {
		c := dialFrom(t, tc.src, s.Addr())
		code, body, closing := c.get("/v1/status")
		if code != http.StatusServiceUnavailable || !strings.Contains(body, tc.reason) || !closing {
			t.Fatalf("from %s: %d %q, closing %v: want 503 %q and Connection: close", tc.src, code, body, closing, tc.reason)
		}
		if !c.closedByServer(5 * time.Second) {
			t.Fatalf("the refused connection from %s is still open", tc.src)
		}
	}

	cli := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	start := time.Now()
	resp, err := cli.Get("http://" + s.Addr() + "/v1/status")
	if err != nil {
		t.Fatalf("GET /v1/status from loopback while strangers hold the API: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /v1/status from loopback: %s after %v", resp.Status, time.Since(start))
	}

	// Loopback's own slots are few: a local hog is capped as well.
	testutil.WaitFor(t, 5*time.Second, "the status connection to be released", func() bool { return s.admitted() == 4 })
	var locals []*client
	for i := range loopbackReserve {
		c := dialFrom(t, "127.0.0.1", s.Addr())
		if code, _, _ := c.get("/healthz"); code != http.StatusOK {
			t.Fatalf("loopback connection %d of %d: %d", i+1, loopbackReserve, code)
		}
		locals = append(locals, c)
	}
	if code, _, _ := dialFrom(t, "127.0.0.1", s.Addr()).get("/healthz"); code != http.StatusServiceUnavailable {
		t.Fatalf("loopback connection past the reserve: %d, want 503", code)
	}

	if n := counterValue(t, s.fv, "tandem_http_refused_total", refusedHTTPAddr); n != 1 {
		t.Errorf("tandem_http_refused_total{reason=%q} = %v, want 1", refusedHTTPAddr, n)
	}
	if n := counterValue(t, s.fv, "tandem_http_refused_total", refusedHTTPTotal); n != 2 {
		t.Errorf("tandem_http_refused_total{reason=%q} = %v, want 2", refusedHTTPTotal, n)
	}
	lines.mu.Lock()
	logged := strings.Join(lines.lines, "\n")
	lines.mu.Unlock()
	for _, want := range []string{"http connection refused: " + refusedHTTPAddr + " remote=127.0.0.2", "remote=127.0.0.4"} {
		if !strings.Contains(logged, want) {
			t.Errorf("no log line with %q in:\n%s", want, logged)
		}
	}

	// A slot a stranger gives back is another stranger's.
	hogs[2].c.Close()
	for _, c := range locals {
		c.c.Close()
	}
	testutil.WaitFor(t, 5*time.Second, "the closed connections' slots to be released", func() bool { return s.admitted() == 3 })
	if code, _, _ := dialFrom(t, "127.0.0.4", s.Addr()).get("/healthz"); code != http.StatusOK {
		t.Fatalf("a stranger once a slot is free: %d, want 200", code)
	}
}

// A kept-alive connection idle for http.idle_timeout is closed, and so is
// one that never sends a whole request; their slots come back.
func TestHTTPIdleConnectionsAreClosed(t *testing.T) {
	s := budgetServer(t, slog.New(slog.DiscardHandler), func(h *config.HTTPConfig) {
		h.IdleTimeout = config.Duration(300 * time.Millisecond)
	})
	kept := dialFrom(t, "127.0.0.2", s.Addr())
	if code, _, closing := kept.get("/healthz"); code != http.StatusOK || closing {
		t.Fatalf("GET /healthz: %d, closing %v", code, closing)
	}
	silent := dialFrom(t, "127.0.0.2", s.Addr())
	half := dialFrom(t, "127.0.0.3", s.Addr())
	if _, err := io.WriteString(half.c, "GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n"); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]*client{"idle kept-alive": kept, "silent": silent, "half a request": half} {
		if !c.closedByServer(5 * time.Second) {
			t.Fatalf("the %s connection is open 5 s on, idle timeout 300ms", name)
		}
	}
	testutil.WaitFor(t, 5*time.Second, "every slot to be released", func() bool { return s.admitted() == 0 })
}
