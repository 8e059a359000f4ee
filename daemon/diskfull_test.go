package daemon

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// A full disk refuses publishes with 0x97 (quota exceeded), corrupts
// nothing, and the gateway takes publishes again once space returns. A
// publish the log took before its save hit the full disk waits for the
// disk instead (its refusal could not be final: the retried save logs it
// once space returns), and is acked then; the device's later publishes on
// that connection wait behind it (acks go in order), another device's are
// refused.
func TestDiskFullRefusesThenRecovers(t *testing.T) {
	dir := testutil.SmallDisk(t, "8m")
	data := filepath.Join(dir, "data")
	d := testGateway(t, data, func(c *config.Config) { c.Cluster.SyncTimeout = config.Duration(2 * time.Second) })
	pub, _ := v5(t, d.MQTTAddr(), "filler", nil)
	if r := publish(t, pub, &paho.Publish{Topic: "before/full", QoS: 1, Payload: []byte("kept")}); r.ReasonCode != 0 {
		t.Fatalf("reason %#x before the disk filled", r.ReasonCode)
	}

	filler := testutil.FillDisk(t, dir)

	type outcome struct {
		r   *paho.PublishResponse
		err error
	}
	send := func(c *paho.Client, topic string, payload []byte) chan outcome {
		ch := make(chan outcome, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			r, err := c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: payload})
			ch <- outcome{r, err}
		}()
		return ch
	}
	check := func(o outcome) bool {
		t.Helper()
		if o.r == nil {
			t.Fatalf("publish on a full disk: %v (want PUBACK 0x97)", o.err)
		}
		switch o.r.ReasonCode {
		case 0:
			return false
		case 0x97:
			return true
		default:
			t.Fatalf("publish on a full disk: reason %#x, want 0x97", o.r.ReasonCode)
		}
		return false
	}
	var refused bool
	var waiting chan outcome // a publish the log took before the disk filled
	// A few pages per commit, so the next one needs room; 100 of them are
	// well past the space the log keeps written ahead of its end.
	payload := make([]byte, 64<<10)
	for i := 0; i < 100 && !refused && waiting == nil; i++ {
		ch := send(pub, "during/full", payload)
		select {
		case o := <-ch:
			refused = check(o)
		case <-time.After(3 * time.Second):
			waiting = ch
		}
	}
	if waiting != nil {
		// Its connection waits; another device is refused at once.
		other, _ := v5(t, d.MQTTAddr(), "other", nil)
		select {
		case o := <-send(other, "during/full", payload):
			refused = check(o)
		case <-time.After(10 * time.Second):
			t.Fatal("a publish from a second device on a full disk got no answer in 10 s (want PUBACK 0x97)")
		}
	}
	if !refused {
		t.Fatal("100 publishes of 64 KiB on a full disk were all acked")
	}

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	if waiting != nil {
		select {
		case o := <-waiting:
			if o.r == nil || o.r.ReasonCode != 0 {
				t.Fatalf("the publish the log took before the disk filled, once space returned: %+v %v, want acked", o.r, o.err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the publish the log took before the disk filled was not acked 30 s after space returned")
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r, err := pub.Publish(ctx, &paho.Publish{Topic: "after/full", QoS: 1, Payload: []byte("back")})
		cancel()
		if r == nil {
			t.Fatal(err)
		}
		if r.ReasonCode == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still refused (%#x) 10 s after space returned", r.ReasonCode)
		}
		time.Sleep(50 * time.Millisecond) // retry pacing, not synchronisation
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	d2 := testGateway(t, data, nil)
	if countTopic(t, d2, "before/full") != 1 || countTopic(t, d2, "after/full") < 1 {
		t.Fatal("acked records missing after the disk-full episode and a restart")
	}
}

// storage.min_free: once the data dir's filesystem has less free space
// than the watermark (filled by someone else: a log file, another
// service), publishes are refused with 0x97 and status says why, while
// subscribers are still served; once space returns, publishes are taken
// again by themselves.
func TestMinFreeRefusesUntilSpaceReturns(t *testing.T) {
	dir := testutil.SmallDisk(t, "64m")
	d := testGateway(t, filepath.Join(dir, "data"), func(c *config.Config) { c.Storage.MinFree = 16 << 20 })
	sub, got := v5(t, d.MQTTAddr(), "watcher", nil)
	subscribe(t, sub, "w/#", 1)
	pub, _ := v5(t, d.MQTTAddr(), "pub", nil)
	if r := publish(t, pub, &paho.Publish{Topic: "w/before", QoS: 1, Payload: []byte("x")}); r.ReasonCode != 0 {
		t.Fatalf("reason %#x with space", r.ReasonCode)
	}
	receive(t, got, 5*time.Second)

	// Another program takes all but 8 MiB: the log itself still has room.
	filler := filepath.Join(dir, "other-program.log")
	if out, err := exec.Command("fallocate", "-l", "48M", filler).CombinedOutput(); err != nil {
		t.Fatalf("fallocate: %v %s", err, out)
	}
	publishUntil := func(want byte, what string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			r, err := pub.Publish(ctx, &paho.Publish{Topic: "w/x", QoS: 1, Payload: []byte("y")})
			cancel()
			if r == nil {
				t.Fatalf("%s: %v", what, err)
			}
			if r.ReasonCode == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: reason %#x after 10 s, want %#x", what, r.ReasonCode, want)
			}
			time.Sleep(50 * time.Millisecond) // retry pacing, not synchronisation
		}
	}
	publishUntil(0x97, "below min_free")
	st, err := d.status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Storage.Refusing == nil || !strings.Contains(*st.Storage.Refusing, "storage.min_free") {
		t.Fatalf("status storage.refusing = %v, want the min_free reason", st.Storage.Refusing)
	}
	if st.Storage.FreeBytes <= 0 || st.Storage.FreeBytes >= 16<<20 || st.Storage.MinFreeBytes != 16<<20 {
		t.Fatalf("status free %d min_free %d", st.Storage.FreeBytes, st.Storage.MinFreeBytes)
	}
	// Subscribers are still served: the session is there and answers.
	subscribe(t, sub, "w2/#", 1)

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	publishUntil(0, "after space returned")
	if st, err := d.status(context.Background()); err != nil || st.Storage.Refusing != nil {
		t.Fatalf("status after space returned: %v %v", err, st.Storage.Refusing)
	}
}
