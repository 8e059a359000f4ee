package netns

import (
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// echoOn runs a TCP server in h's namespace on port: it answers each
// line-less chunk with the same bytes, and "bye" with "ok" and a close.
func echoOn(t *testing.T, h *Host, port string) {
	t.Helper()
	var ln net.Listener
	if err := h.Do(func() (err error) {
		ln, err = net.Listen("tcp", h.Addr()+":"+port)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b := make([]byte, 64)
				for {
					n, err := c.Read(b)
					if err != nil {
						return
					}
					if string(b[:n]) == "bye" {
						c.Write([]byte("ok"))
						return
					}
					c.Write(b[:n])
				}
			}()
		}
	}()
}

// dialFrom connects from h's namespace.
func dialFrom(t *testing.T, h *Host, addr string) net.Conn {
	t.Helper()
	var c net.Conn
	if err := h.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", addr, 5*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip sends msg and times the echo.
func roundTrip(t *testing.T, c net.Conn, msg string) time.Duration {
	t.Helper()
	start := time.Now()
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, len(msg))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, b); err != nil || string(b) != msg {
		t.Fatalf("echo: %q %v", b, err)
	}
	return time.Since(start)
}

func TestRelayDelaysBothWaysAndDropsRepliesBeforeAClose(t *testing.T) {
	Skip(t, "iptables")
	nt := New(t, 2)
	a, b := nt.Hosts[0], nt.Hosts[1]
	echoOn(t, b, "7000")
	echoOn(t, a, "7000")
	l := nt.Relay(a, b, 7000)

	c := dialFrom(t, a, b.Addr()+":7000")
	if rt := roundTrip(t, c, "x"); rt > 100*time.Millisecond {
		t.Fatalf("round trip without delay: %v", rt)
	}
	l.SetDelay(150 * time.Millisecond)
	if rt := roundTrip(t, c, "y"); rt < 300*time.Millisecond || rt > 1500*time.Millisecond {
		t.Fatalf("round trip at 150 ms one way: %v, want about 300ms", rt)
	}
	// The other way round too: b's connections to a go through b's
	// relay, and a new connection's first bytes wait for the handshake's
	// round trip as well: two round trips, 600 ms (timers may fire a
	// little early by the clock read here; one round trip would be 300).
	back := dialFrom(t, b, a.Addr()+":7000")
	if rt := roundTrip(t, back, "z"); rt < 550*time.Millisecond {
		t.Fatalf("first round trip b -> a at 150 ms one way: %v, want about 600ms", rt)
	}
	l.SetDelay(0)

	// A one-shot answer followed by a close is lost, and the close too;
	// what came before it is not.
	l.DropReplies(true)
	k := dialFrom(t, a, b.Addr()+":7000")
	if rt := roundTrip(t, k, "hello"); rt > time.Second {
		t.Fatalf("echo while dropping replies: %v", rt)
	}
	k.Write([]byte("bye"))
	k.SetReadDeadline(time.Now().Add(time.Second))
	if n, err := k.Read(make([]byte, 8)); n != 0 || !isTimeout(err) {
		t.Fatalf("the answer before the close: read %d, %v; want a timeout", n, err)
	}
	l.DropReplies(false)
	k2 := dialFrom(t, a, b.Addr()+":7000")
	k2.Write([]byte("bye"))
	k2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if got, err := io.ReadAll(k2); string(got) != "ok" || err != nil {
		t.Fatalf("answer with replies no longer dropped: %q %v", got, err)
	}
	l.Close()
	if rt := roundTrip(t, dialFrom(t, a, b.Addr()+":7000"), "w"); rt > 100*time.Millisecond {
		t.Fatalf("after Close: %v", rt)
	}
}

func TestLossDropsSomePackets(t *testing.T) {
	Skip(t, "iptables")
	nt := New(t, 2)
	a, b := nt.Hosts[0], nt.Hosts[1]
	nt.Loss(a, b, 0.5)
	nt.Loss(a, b, 0.3) // replaces the rate
	out := a.Run("iptables", "-w", "-S", "INPUT")
	if strings.Count(out, "statistic") != 1 || !strings.Contains(out, "0.29999") {
		t.Fatalf("rules after two Loss calls, want one at 0.3:\n%s", out)
	}
	nt.Loss(a, b, 0)
	if out := b.Run("iptables", "-w", "-S", "INPUT"); strings.Contains(out, "statistic") {
		t.Fatalf("rules after Loss 0:\n%s", out)
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}
