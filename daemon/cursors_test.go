package daemon

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// Issue 31: cursor records repeated every client id (60 KB ids: 1,185 MB
// written in 5 s). In a cluster at feature level 2 a cursor record names
// a session by its start record's index: a few bytes, whatever the id;
// and the device that moves to the other member is handed there only
// what it had not acked.
func TestCursorRecordsOfALongClientIDAreShortAndMoveTheSession(t *testing.T) {
	long := func(c *config.Config) { c.MQTT.MaxClientIDLength = 65535 }
	g1 := clusterGateway(t, "gw-cur-1", long)
	g2 := clusterGateway(t, "gw-cur-2", long)
	joinWith(t, g2, inviteToken(t, g1))
	for _, d := range []*Daemon{g1, g2} {
		testutil.WaitFor(t, 15*time.Second, d.cfg.Node.Name+" at feature level 2", func() bool {
			return statusOfGW(t, d).Cluster.FeatureLevel >= storage.FeatureControlKinds
		})
	}
	id := strings.Repeat("d", 60000)
	expiry := uint32(300)
	dev, got := v5(t, g1.MQTTAddr(), id, &paho.Connect{CleanStart: false, Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}})
	subscribe(t, dev, "cur/#", 1)
	pub, _ := v5(t, g1.MQTTAddr(), "cur-pub", nil)
	for i := 0; i < 10; i++ {
		publish(t, pub, &paho.Publish{Topic: "cur/x", QoS: 1, Payload: []byte(fmt.Sprint("m", i))})
		receive(t, got, 5*time.Second)
	}
	if err := dev.Disconnect(&paho.Disconnect{}); err != nil {
		t.Fatal(err)
	}
	// Gone from gw-1, its cursor logged before its "off" record (as it
	// went, or by the batch every 100 ms before that), and that in
	// gw-2's log. It used to wait for a cursor record after the "off",
	// which never came when the periodic batch had logged the cursor
	// between the last PUBACK and the DISCONNECT (a CI run, under load).
	testutil.WaitFor(t, 10*time.Second, "the device's going to reach gw-2", func() bool {
		for _, r := range logRecords(t, g2) {
			if r.Kind == storage.KindSession && strings.Contains(string(r.Payload), `"off"`) {
				return true
			}
		}
		return false
	})
	testutil.WaitFor(t, 10*time.Second, "gw-2 to apply its log", func() bool {
		return statusOfGW(t, g2).Log.AppliedIndex >= statusOfGW(t, g2).Log.LastIndex
	})
	cursors := 0
	for _, r := range logRecords(t, g2) {
		if r.Kind != storage.KindCursors {
			continue
		}
		cursors++
		if len(r.Payload) > 32 || r.Legacy {
			t.Fatalf("a cursor record of %d bytes (legacy %v) for one session", len(r.Payload), r.Legacy)
		}
	}
	if cursors == 0 {
		t.Fatal("no cursor record in the log")
	}
	c, moved, ca := resume(t, g2.MQTTAddr(), id, expiry)
	defer c.Disconnect(&paho.Disconnect{})
	if !ca.SessionPresent {
		t.Fatal("the session is not present on the other member")
	}
	publish(t, pub, &paho.Publish{Topic: "cur/x", QoS: 1, Payload: []byte("after")})
	if p := receive(t, moved, 10*time.Second); string(p.Payload) != "after" {
		t.Fatalf("on the other member the device was handed %q again, which it had acked", p.Payload)
	}
	assertAnswersAndStops(t, g2)
}
