package daemon

import (
	"runtime"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// TestStopEndsEveryGoroutine: Stop waits for everything the gateway
// started (broker connections, the node, the keeper and its rounds, the
// HTTP server, the sampler), with a device still connected, so a stopped
// gateway leaves nothing running that could still write to its data dir.
func TestStopEndsEveryGoroutine(t *testing.T) {
	base := runtime.NumGoroutine()
	d := testGateway(t, t.TempDir(), nil)
	c := dialRaw(t, d.MQTTAddr(), "leak-check", true)
	c.send(0x32, pubBody("leak/check", 1, "x"))
	if typ, body := c.read(); typ != 0x40 || len(body) < 2 {
		t.Fatalf("PUBACK: %#x %v", typ, body)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "the gateway's goroutines to end", func() bool { return runtime.NumGoroutine() <= base })
}
