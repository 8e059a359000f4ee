package uplink

import (
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
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

// Packets that paho.golang writes from several goroutines at once (acks
// of downlink messages beside a SUBSCRIBE, pings, publishes) reach the
// cloud whole: paho writes a packet in pieces and holds the conn's lock
// over them, so a batchConn must be that lock. Without it the cloud saw a
// malformed packet and dropped the link, and the ack with it.
func TestBatchConnKeepsPahoPacketsWhole(t *testing.T) {
	a, b := net.Pipe()
	bc := newBatchConn(a)
	const writers, each = 4, 300
	read := make(chan error, 1)
	go func() {
		seen := 0
		for seen < writers*each {
			cp, err := packets.ReadPacket(b)
			if err != nil {
				read <- fmt.Errorf("packet %d: %w", seen, err)
				return
			}
			p, ok := cp.Content.(*packets.Publish)
			if !ok || !strings.HasPrefix(p.Topic, "t/") || len(p.Payload) != 64 {
				read <- fmt.Errorf("packet %d is torn: %T %+v", seen, cp.Content, cp.Content)
				return
			}
			seen++
		}
		read <- nil
	}()
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				cp := packets.NewControlPacket(packets.PUBLISH)
				cp.Content = &packets.Publish{Topic: fmt.Sprintf("t/%d", w), QoS: 1, PacketID: uint16(w*each + i + 1),
					Properties: &packets.Properties{}, Payload: make([]byte, 64)}
				if _, err := cp.WriteTo(bc); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-read:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the reader did not get every packet")
	}
	if err := bc.Close(); err != nil {
		t.Fatal(err)
	}
}
