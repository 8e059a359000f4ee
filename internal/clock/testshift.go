//go:build tandem_testclock

package clock

import (
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// A test build (-tags tandem_testclock) lets an e2e test move a running
// gateway's wall clock: TANDEM_TEST_CLOCK_SHIFT names a file holding a
// duration ("43800h", "-43800h") that is added to the host's wall clock,
// read every 20 ms, while the monotonic clock runs on. Release builds
// have no such door.
func init() {
	path := os.Getenv("TANDEM_TEST_CLOCK_SHIFT")
	if path == "" {
		return
	}
	var shift atomic.Int64
	read := func() {
		b, err := os.ReadFile(path)
		if err != nil {
			return
		}
		if d, err := time.ParseDuration(strings.TrimSpace(string(b))); err == nil {
			shift.Store(int64(d))
		} else if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil {
			shift.Store(n)
		}
	}
	read()
	Default = New(func() time.Time { return time.Now().Add(time.Duration(shift.Load())) })
	// TANDEM_TEST_CLOCK_RAW=1: jumps are detected but followed, as a
	// build without this package would: the control that shows a test
	// of jumps can fail.
	Default.raw = os.Getenv("TANDEM_TEST_CLOCK_RAW") == "1"
	go func() { // the test build's only: lives as long as the process
		for range time.Tick(20 * time.Millisecond) {
			read()
		}
	}()
}
