package admin

import (
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// TestServePprofStopEndsItsGoroutines: `tandem run --pprof` serves the
// profiles, and its stop function ends the server, the connection a client
// keeps open included, so nothing of it outlives the command.
func TestServePprofStopEndsItsGoroutines(t *testing.T) {
	base := runtime.NumGoroutine()
	addr := testutil.FreeAddr(t)
	stop, err := ServePprof(addr)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get("http://" + addr + "/debug/pprof/")
	if err != nil {
		stop()
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET /debug/pprof/: %s", resp.Status)
	}
	stop() // the kept-alive connection is still open on both sides here
	tr.CloseIdleConnections()
	testutil.WaitFor(t, 5*time.Second, "the pprof server's goroutines to end", func() bool { return runtime.NumGoroutine() <= base })
	if _, err := http.Get("http://" + addr + "/debug/pprof/"); err == nil {
		t.Error("the pprof server still answers after stop")
	}
}
