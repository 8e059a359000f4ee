package testutil

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// SmallDisk mounts a tmpfs of size ("8m", "64m") on a fresh directory,
// unmounted when the test ends: a small disk a test can fill. It needs root
// and skips without it (fails under CI=true, which runs as root).
func SmallDisk(t testing.TB, size string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("needs root to mount a small tmpfs (CI runs as root)")
		}
		t.Skip("needs root to mount a small tmpfs as a nearly full disk")
	}
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size, "tandem-test", dir).CombinedOutput(); err != nil {
		t.Fatalf("cannot mount a tmpfs: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", "-l", dir).Run() })
	return dir
}

// FillDisk fills the filesystem holding dir to the last byte with a file
// of its own in dir, whose path it returns: remove it to give the space
// back.
func FillDisk(t testing.TB, dir string) string {
	t.Helper()
	filler := filepath.Join(dir, "filler")
	f, err := os.Create(filler)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 64<<10)
	for {
		if _, err := f.Write(chunk); err != nil {
			break
		}
	}
	for n := 4096; n > 0; n /= 2 {
		for {
			if _, err := f.Write(chunk[:n]); err != nil {
				break
			}
		}
	}
	return filler
}
