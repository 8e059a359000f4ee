package uplink

import (
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// Writes from several goroutines reach the peer whole and, per writer, in
// order; Close writes what is queued.
func TestBatchConnKeepsOrderAndFlushesOnClose(t *testing.T) {
	a, b := net.Pipe()
	bc := newBatchConn(a)
	got := make(chan string, 1)
	go func() { all, _ := io.ReadAll(b); got <- string(all) }()
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				if _, err := bc.Write(fmt.Appendf(nil, "<%d:%d>", w, i)); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := bc.Close(); err != nil {
		t.Fatal(err)
	}
	s := <-got
	for w := range 3 {
		last := -1
		for _, part := range strings.Split(s, "<")[1:] {
			var pw, pi int
			if _, err := fmt.Sscanf(part, "%d:%d>", &pw, &pi); err != nil {
				t.Fatalf("torn write %q", part)
			}
			if pw == w {
				if pi != last+1 {
					t.Fatalf("writer %d: %d after %d", w, pi, last)
				}
				last = pi
			}
		}
		if last != 199 {
			t.Fatalf("writer %d: last %d arrived, want 199", w, last)
		}
	}
}

// A peer that reads nothing (a stalled link) does not hold Close up for
// longer than closeWait, and later writes fail.
func TestBatchConnCloseOnAStalledLink(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	bc := newBatchConn(a)
	if _, err := bc.Write([]byte("never read")); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	bc.Close()
	if d := time.Since(start); d > closeWait+time.Second {
		t.Fatalf("Close took %v on a stalled link", d)
	}
	if _, err := bc.Write([]byte("x")); err == nil {
		t.Fatal("a write after Close succeeded")
	}
}
