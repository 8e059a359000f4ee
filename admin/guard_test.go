package admin

import (
	"net"
	"testing"
	"time"
)

// TestLimitListener: past its cap, a connection waits in the backlog until
// one of the accepted ones closes; Close ends a waiting Accept.
func TestLimitListener(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := newLimitListener(inner, 2)
	accepted := make(chan net.Conn, 3)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	for range 3 {
		c, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	first, second := <-accepted, <-accepted
	if l := ln.(*limitListener); len(l.sem) != cap(l.sem) {
		t.Fatalf("%d of %d slots held with two connections open", len(l.sem), cap(l.sem))
	}
	select {
	case <-accepted:
		t.Fatal("a third connection accepted past the cap of 2")
	default:
	}
	first.Close()
	select {
	case c := <-accepted:
		c.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the third connection not accepted after one closed")
	}
	second.Close()
	ln.Close()
	for range accepted {
	}
}
