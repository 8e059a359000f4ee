//go:build unix

package testutil

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// SystemTest skips a test that changes this system (units, users, /etc,
// installed packages) unless it runs in CI as root, what saying what it
// changes, and serialises it with every other such test of the module
// through one lock file: go test runs packages in parallel.
func SystemTest(t testing.TB, what string) {
	t.Helper()
	if os.Getenv("CI") != "true" {
		t.Skip(what + ": runs with CI=true as root")
	}
	if os.Geteuid() != 0 {
		t.Skip(what + ": needs root")
	}
	f, err := os.OpenFile(filepath.Join(os.TempDir(), "tandem-system-tests.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
}
