// Package testutil holds the helpers the module's tests share, so that no
// test file keeps its own copy: finding a tool the test needs, and (as the
// tests move here) free ports, polling with a deadline and a locked log
// buffer. It imports no package of ours, so that any package's internal
// tests may use it. It starts no goroutines.
package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// NeedTool returns the path of the program name, or skips the test when it
// is not installed. Under CI=true a missing tool fails the test instead:
// .ci/run installs every tool the tests use, so a skip there would hide a
// broken setup.
func NeedTool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s not found: .ci/run should have installed it", name)
		}
		t.Skipf("%s not found", name)
	}
	return p
}
