package mqtt

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"
)

func TestConnRateTokenBucket(t *testing.T) {
	c := newConnRate(2, 3) // 2 per second, 3 at once
	t0 := time.Unix(1000, 0)
	for i := 0; i < 3; i++ {
		if !c.allow("a", t0) {
			t.Fatalf("connection %d of the burst refused", i+1)
		}
	}
	if c.allow("a", t0) {
		t.Fatal("a 4th connection at once allowed")
	}
	if !c.allow("b", t0) {
		t.Fatal("another address refused")
	}
	if !c.allow("a", t0.Add(500*time.Millisecond)) {
		t.Fatal("a token refilled after 1/rate refused")
	}
	if c.allow("a", t0.Add(500*time.Millisecond)) {
		t.Fatal("more than the refill allowed")
	}
	var off *connRate
	if !off.allow("a", t0) {
		t.Fatal("a nil (disabled) limit refused")
	}
}

func TestConnRatePrunesRefilledBuckets(t *testing.T) {
	c := newConnRate(1, 1)
	t0 := time.Unix(1000, 0)
	for i := 0; i < maxBuckets; i++ {
		c.allow(fmt.Sprint(i), t0)
	}
	c.allow("new", t0.Add(2*time.Second)) // all others have refilled
	if len(c.buckets) != 1 {
		t.Fatalf("%d buckets after pruning, want 1", len(c.buckets))
	}
}

func TestSourceKeyGroupsIPv6By64(t *testing.T) {
	for _, tt := range []struct{ addr, want string }{
		{"192.0.2.7:5000", "192.0.2.7"},
		{"[::ffff:192.0.2.7]:5000", "192.0.2.7"},
		{"[2001:db8:1:2:3:4:5:6]:5000", "2001:db8:1:2::/64"},
		{"[2001:db8:1:2:ffff::1]:1", "2001:db8:1:2::/64"},
	} {
		a, err := net.ResolveTCPAddr("tcp", tt.addr)
		if err != nil {
			t.Fatal(err)
		}
		if got := SourceKey(a); got != tt.want {
			t.Errorf("SourceKey(%s) = %s, want %s", tt.addr, got, tt.want)
		}
	}
}

func TestLimitedHandlerLogsOncePerKey(t *testing.T) {
	var buf bytes.Buffer
	h := limitedHandler{slog.NewTextHandler(&buf, nil), NewLogLimiter(time.Minute)}
	log := slog.New(h)
	t0 := time.Now()
	for i := 0; i < 100; i++ {
		log.Warn("publish not acked", "client", "c1")
	}
	log.Warn("publish not acked", "client", "c2")
	log.Error("publish not acked", "client", "c1") // errors always pass
	log.Debug("x")
	if n := strings.Count(buf.String(), "publish not acked"); n != 3 {
		t.Fatalf("%d lines, want one per client and the error:\n%s", n, buf.String())
	}
	// After the interval, the next line carries the count held back.
	buf.Reset()
	r := slog.NewRecord(t0.Add(2*time.Minute), slog.LevelWarn, "publish not acked", 0)
	r.AddAttrs(slog.String("client", "c1"))
	if err := h.Handle(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), "suppressed=99") {
		t.Fatalf("next line after the interval: %q, want suppressed=99", buf.String())
	}
}

func TestLogLimiterBoundsItsKeys(t *testing.T) {
	l := NewLogLimiter(time.Minute)
	t0 := time.Unix(1000, 0)
	for i := 0; i < maxLogKeys; i++ {
		l.Allow(fmt.Sprint(i), t0)
	}
	if ok, _ := l.Allow("one more", t0); !ok {
		t.Fatal("first line of the overflow key refused")
	}
	if ok, _ := l.Allow("and another", t0); ok {
		t.Fatal("a flood of distinct keys must share one line a minute")
	}
	if len(l.seen) > maxLogKeys+1 {
		t.Fatalf("%d keys kept", len(l.seen))
	}
}

func TestKeepAliveBounds(t *testing.T) {
	l := Limits{KeepAliveMin: 10, KeepAliveMax: 600}
	for _, tt := range []struct {
		in, want uint16
		ok       bool
	}{
		{60, 60, true}, {10, 10, true}, {600, 600, true},
		{5, 10, false}, {601, 600, false}, {0, 600, false},
	} {
		if got, ok := l.keepAlive(tt.in); got != tt.want || ok != tt.ok {
			t.Errorf("keepAlive(%d) = %d, %v; want %d, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
	none := Limits{}
	if got, ok := none.keepAlive(0); got != 0 || !ok {
		t.Errorf("no bounds: keepAlive(0) = %d, %v", got, ok)
	}
}
