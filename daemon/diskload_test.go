package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// loadClient is one device publishing in a loop, and what came of it.
type loadClient struct {
	mu       sync.Mutex
	acked    []int // sequence numbers acked, in order
	refused  int   // 0x97 answers
	others   []string
	sinceGot bool      // an ack came since the last reset
	waiting  time.Time // when the publish in flight was sent
}

// sent notes a publish going out.
func (l *loadClient) sent() {
	l.mu.Lock()
	l.waiting = time.Now()
	l.mu.Unlock()
}

// waitingFor is how long the publish in flight has waited.
func (l *loadClient) waitingFor() time.Duration {
	if l.waiting.IsZero() {
		return 0
	}
	return time.Since(l.waiting)
}

func (l *loadClient) note(seq int, r *paho.PublishResponse, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.waiting = time.Time{}
	switch {
	case r == nil: // paho.golang returns the PUBACK with an error for a reason ≥ 0x80
		l.others = append(l.others, err.Error())
	case r.ReasonCode == 0:
		l.acked = append(l.acked, seq)
		l.sinceGot = true
	case r.ReasonCode == 0x97:
		l.refused++
	default:
		l.others = append(l.others, fmt.Sprintf("reason %#x", r.ReasonCode))
	}
}

// Several devices keep publishing while the disk fills under them, and a
// persistent session that is offline has a log budget's worth of messages
// waiting (more: retention drops the oldest of them). Every publish is
// acked or refused with 0x97, never another outcome; a publish the log
// had taken when the disk filled waits for the disk (refusing it could
// not be final: the retried save logs it once space returns), and is
// acked then; the status answers throughout; once space returns every
// device is acked again; nothing on disk is corrupted
// (the gateway restarts on it with the newest acked records); and the
// session, back, gets the messages retention kept and the count of those
// it dropped before the session had them.
func TestDiskFullUnderLoadWithABudgetOfUndeliveredMessages(t *testing.T) {
	dir := testutil.SmallDisk(t, "48m")
	data := filepath.Join(dir, "data")
	budget := func(c *config.Config) { c.Storage.MaxBytes = 12 << 20 }
	d := testGateway(t, data, budget)

	expiry := uint32(3600)
	persistent := func() *paho.Connect {
		return &paho.Connect{Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}}
	}
	away, _ := v5(t, d.MQTTAddr(), "away", persistent())
	subscribe(t, away, "load/#", 1)
	if err := away.Disconnect(&paho.Disconnect{}); err != nil {
		t.Fatal(err)
	}

	const devices = 4
	payload := make([]byte, 16<<10)
	clients := make([]*loadClient, devices)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := range devices {
		clients[c] = &loadClient{}
		pub, _ := v5(t, d.MQTTAddr(), fmt.Sprintf("dev-%d", c), nil)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seq := 0; ; seq++ {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				clients[c].sent()
				r, err := pub.Publish(ctx, &paho.Publish{Topic: fmt.Sprintf("load/%d/%d", c, seq), QoS: 1, Payload: payload})
				cancel()
				clients[c].note(seq, r, err)
			}
		}()
	}
	stopLoad := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopLoad()
	each := func(what string, ok func(l *loadClient) bool) {
		t.Helper()
		defer func() {
			if t.Failed() {
				for c, l := range clients {
					l.mu.Lock()
					t.Logf("dev-%d: %d acked, %d refused, other outcomes %v", c, len(l.acked), l.refused, l.others[:min(len(l.others), 3)])
					l.mu.Unlock()
				}
				t.Logf("status: %+v", statusOfGW(t, d).Storage)
			}
		}()
		testutil.WaitFor(t, 30*time.Second, what, func() bool {
			for _, l := range clients {
				l.mu.Lock()
				good := ok(l)
				l.mu.Unlock()
				if !good {
					return false
				}
			}
			return true
		})
	}

	// The session's messages fill the budget: retention drops the oldest.
	testutil.WaitFor(t, 60*time.Second, "retention dropping what the session has not had", func() bool {
		return statusOfGW(t, d).Storage.DroppedRecords > 0
	})
	t.Logf("retention dropping: data dir %d bytes for a budget of %d", statusOfGW(t, d).Storage.UsedBytes, 12<<20)
	filler := testutil.FillDisk(t, dir)
	each("every device refused with 0x97 on the full disk, or waiting for a publish the log took before", func(l *loadClient) bool {
		return l.refused > 0 || l.waitingFor() > 3*time.Second
	})
	refused := 0
	for _, l := range clients {
		l.mu.Lock()
		refused += l.refused
		l.mu.Unlock()
	}
	if refused == 0 {
		// Every device waits for a publish the log took before the disk
		// filled (a run under load once had all of them so): a device
		// that publishes now is the one to refuse.
		fresh, _ := v5(t, d.MQTTAddr(), "fresh", nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r, err := fresh.Publish(ctx, &paho.Publish{Topic: "load/fresh", QoS: 1, Payload: payload})
		cancel()
		if r == nil || r.ReasonCode != 0x97 {
			t.Fatalf("no publish refused on the full disk: a new device's publish got %+v, %v; want 0x97", r, err)
		}
		_ = fresh.Disconnect(&paho.Disconnect{})
	}
	if st := statusOfGW(t, d); st.Storage.Refusing == nil {
		t.Fatalf("the status of a gateway on a full disk says nothing of it: %+v", st.Storage)
	}
	for _, l := range clients {
		l.mu.Lock()
		l.sinceGot = false
		l.mu.Unlock()
	}
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	each("every device acked again once space returned", func(l *loadClient) bool { return l.sinceGot })
	stopLoad()
	for c, l := range clients {
		if len(l.others) > 0 {
			t.Errorf("dev-%d: outcomes other than an ack or 0x97: %v", c, l.others[:min(len(l.others), 5)])
		}
		t.Logf("dev-%d: %d acked, %d refused with 0x97", c, len(l.acked), l.refused)
	}

	// Nothing corrupted: a restart opens the data as it is, with the newest
	// acked record of every device.
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	d2 := testGateway(t, data, budget)
	for c, l := range clients {
		topic := fmt.Sprintf("load/%d/%d", c, l.acked[len(l.acked)-1])
		if countTopic(t, d2, topic) != 1 {
			t.Errorf("dev-%d's last acked record (%s) is not in the log after the restart", c, topic)
		}
	}

	// The session comes back: present, the kept messages from where
	// retention left off, and the count of those it dropped.
	back, got := v5(t, d2.MQTTAddr(), "away", persistent())
	defer back.Disconnect(&paho.Disconnect{})
	if p := receive(t, got, 10*time.Second); len(p.Payload) != len(payload) {
		t.Fatalf("the session got a message of %d bytes, want %d", len(p.Payload), len(payload))
	}
	testutil.WaitFor(t, 10*time.Second, "the session's dropped messages counted", func() bool {
		m := metric(scrape(t, d2), "tandem_session_dropped_messages_total")
		return m != nil && m.GetCounter().GetValue() > 0
	})
	if statusOfGW(t, d2) == nil {
		t.Fatal("the gateway does not answer")
	}
}
