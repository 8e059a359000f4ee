package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// SIGTERM on a full disk is a clean stop (exit 0): the last checkpoint of
// the WAL into the data file cannot be written, and the gateway says so;
// nothing acked is lost by that, since the WAL holds it: a restart with
// space back replays it.
func TestSIGTERMOnAFullDiskExitsZeroAndLosesNothing(t *testing.T) {
	dir := testutil.SmallDisk(t, "8m")
	data := filepath.Join(dir, "data")
	p := startTandem(t, data, nil)
	pub := connectV5(t, p.addrs.mqtt, "filler")
	acked := map[string]bool{}
	// waiting is the code send returns for a publish not answered within
	// its deadline: one the log took before its save hit the full disk
	// waits for the disk (docs/acks.md), and is not acked.
	const waiting = 0xFF
	send := func(c *paho.Client, topic string, size int) byte {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		r, err := c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: make([]byte, size)})
		if r == nil && errors.Is(err, context.DeadlineExceeded) && strings.HasPrefix(topic, "full/") {
			return waiting
		}
		if r == nil {
			t.Fatalf("publish %s: %v", topic, err)
		}
		if r.ReasonCode == 0 {
			acked[topic] = true
		}
		return r.ReasonCode
	}
	for i := range 20 {
		send(pub, fmt.Sprintf("before/%d", i), 16<<10)
	}
	filler := testutil.FillDisk(t, dir)
	// What is acked now is in the WAL only: the data file cannot grow.
	for i := 0; i < 200; i++ {
		if code := send(pub, fmt.Sprintf("full/%d", i), 1<<10); code == 0x97 || code == waiting {
			break
		}
	}
	if code := p.stop(15 * time.Second); code != 0 {
		t.Fatalf("SIGTERM on a full disk: exit %d, want 0\n%s", code, p.out.Tail(3000))
	}
	if !strings.Contains(p.out.String(), "stopped without checkpointing the WAL") {
		t.Fatalf("no line saying what could not be checkpointed:\n%s", p.out.Tail(3000))
	}

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	held := map[string]bool{}
	for _, r := range runInspect(t, data) {
		held[r.Topic] = true
	}
	for topic := range acked {
		if !held[topic] {
			t.Errorf("acked %s missing after the stop", topic)
		}
	}
	p2 := startTandem(t, data, nil)
	if send(connectV5(t, p2.addrs.mqtt, "after"), "after", 1) != 0 {
		t.Fatal("publish refused after the restart with space back")
	}
	if code := p2.stop(15 * time.Second); code != 0 {
		t.Fatalf("stop after the restart: exit %d", code)
	}
	t.Logf("%d records acked, all in the log after the stop and the restart; %d in it", len(acked), len(held))
}

// connectV5 connects an MQTT 5 client to addr.
func connectV5(t *testing.T, addr, id string) *paho.Client {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := paho.NewClient(paho.ClientConfig{ClientID: id, Conn: conn})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if ca, err := c.Connect(ctx, &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 30}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect %s: %v %+v", id, err, ca)
	}
	return c
}
