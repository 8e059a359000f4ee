package daemon

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// In a 2-gateway cluster the slave is a learner, which cannot be handed
// the mastership: a master below storage.min_free keeps it, refuses with
// 0x97 and says why, naming the way out (/healthz 503).
func TestPairMasterBelowMinFreeSaysWhyItKeepsTheMastership(t *testing.T) {
	dir := testutil.SmallDisk(t, "64m")
	g1 := testGateway(t, filepath.Join(dir, "data"), func(c *config.Config) {
		clusterTestConfig(c, "gw-1")
		c.Storage.MinFree = 16 << 20
		c.MQTT.ReasonStrings = "all" // acks carry a bare code otherwise
	})
	g2 := clusterGateway(t, "gw-2", nil)
	joinWith(t, g2, inviteToken(t, g1))
	testutil.WaitFor(t, 10*time.Second, "gw-2 a caught-up learner", func() bool {
		v, l, ok := shape(statusOfGW(t, g1))
		return v == 0 && l == 1 && ok
	})
	if out, err := exec.Command("fallocate", "-l", "48M", filepath.Join(dir, "other-program.log")).CombinedOutput(); err != nil {
		t.Fatalf("fallocate: %v %s", err, out)
	}
	testutil.WaitFor(t, 10*time.Second, "gw-1 saying why it keeps the mastership", func() bool {
		err := g1.notServing()
		return err != nil && strings.Contains(err.Error(), "storage.min_free") && strings.Contains(err.Error(), "tandem promote")
	})
	if s := statusOfGW(t, g1); s.Role != "master" || s.Storage.Refusing == nil || !strings.Contains(*s.Storage.Refusing, "tandem promote") {
		t.Fatalf("gw-1 role %s, refusing %v: want the master (no voter to hand over to), saying why", s.Role, s.Storage.Refusing)
	}
	pub, _ := v5(t, g1.MQTTAddr(), "pub", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r, err := pub.Publish(ctx, &paho.Publish{Topic: "a/x", QoS: 1, Payload: []byte("x")}); r == nil || r.ReasonCode != 0x97 {
		t.Fatalf("publish on the full master: %+v %v, want 0x97", r, err)
	} else if why := r.Properties.ReasonString; !strings.Contains(why, "storage.min_free") || strings.ContainsFunc(why, unicode.IsControl) {
		t.Fatalf("reason string %q: want one line naming storage.min_free", why)
	}
}
