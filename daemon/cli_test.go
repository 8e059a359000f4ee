package daemon

import (
	"crypto/sha256"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

func TestCheckNamesKeyAndLine(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "tandem.yaml")
	os.WriteFile(bad, []byte("node:\n  name: gw\ncluster:\n  sync_timeout: 5\n"), 0o644)
	code, _, stderr := runMain(t, "check", "--config", bad)
	if code != ExitUsage {
		t.Fatalf("exit %d, want 2; stderr %s", code, stderr)
	}
	if !strings.Contains(stderr, "tandem.yaml:4") || !strings.Contains(stderr, "cluster.sync_timeout") {
		t.Fatalf("error does not name line 4 and the key: %s", stderr)
	}
	code, _, stderr = runMain(t, "run", "--config", bad)
	if code != ExitUsage || !strings.Contains(stderr, "cluster.sync_timeout") {
		t.Fatalf("run with a bad config: exit %d, %s", code, stderr)
	}
	good := filepath.Join(dir, "good.yaml")
	os.WriteFile(good, []byte("topics:\n  - match: a/#\n    ack: sync\n"), 0o644)
	if code, out, stderr := runMain(t, "check", "--config", good); code != ExitOK || !strings.Contains(out, "ok") {
		t.Fatalf("good config: exit %d %s %s", code, out, stderr)
	}
	if code, _, _ := runMain(t, "run", "--no-such-flag"); code != ExitUsage {
		t.Fatalf("unknown flag: exit %d, want 2", code)
	}
}

func TestVersion(t *testing.T) {
	code, out, _ := runMain(t, "version")
	if code != 0 || !strings.HasPrefix(out, "tandem ") || !strings.Contains(out, "go1") {
		t.Fatalf("version: %d %q", code, out)
	}
}

func fileHash(t *testing.T, p string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

func runArgs(dir string) []string {
	return []string{"run", "--data", dir, "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0", "--peer", "127.0.0.1:0"}
}

func TestRunRefusesBadDataDirs(t *testing.T) {
	t.Run("not a directory", func(t *testing.T) {
		f := filepath.Join(t.TempDir(), "file")
		os.WriteFile(f, []byte("x"), 0o644)
		code, _, stderr := runMain(t, runArgs(filepath.Join(f, "data"))...)
		if code != ExitFailure || !strings.Contains(stderr, "not a directory") {
			t.Fatalf("exit %d: %s", code, stderr)
		}
	})
	t.Run("empty data file", func(t *testing.T) {
		dir := t.TempDir()
		p := filepath.Join(dir, "tandem.db")
		os.WriteFile(p, nil, 0o640)
		code, _, stderr := runMain(t, runArgs(dir)...)
		if code != ExitFailure || !strings.Contains(stderr, "empty") {
			t.Fatalf("exit %d: %s", code, stderr)
		}
		if st, err := os.Stat(p); err != nil || st.Size() != 0 {
			t.Fatalf("empty file changed: %v %v", st, err)
		}
	})
	t.Run("truncated data file", func(t *testing.T) {
		dir := t.TempDir()
		d := testGateway(t, dir, nil)
		d.Stop()
		p := filepath.Join(dir, "tandem.db")
		// Half of what bbolt needs: the file itself is larger, with zeroed
		// space past bbolt's high-water mark.
		bdb, err := bolt.Open(p, 0o600, &bolt.Options{ReadOnly: true, Timeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		var need int64
		_ = bdb.View(func(tx *bolt.Tx) error { need = tx.Size(); return nil })
		bdb.Close()
		if err := os.Truncate(p, need/2); err != nil {
			t.Fatal(err)
		}
		before := fileHash(t, p)
		code, _, stderr := runMain(t, runArgs(dir)...)
		if code != ExitFailure || !strings.Contains(stderr, "truncated") {
			t.Fatalf("exit %d: %s", code, stderr)
		}
		if fileHash(t, p) != before {
			t.Fatal("truncated file was modified")
		}
	})
	t.Run("held by another tandem", func(t *testing.T) {
		dir := t.TempDir()
		testGateway(t, dir, nil)
		code, _, stderr := runMain(t, runArgs(dir)...)
		if code != ExitFailure || !strings.Contains(stderr, "in use") {
			t.Fatalf("exit %d: %s", code, stderr)
		}
	})
}

func TestPackagedConfigIsValid(t *testing.T) {
	if code, out, stderr := runMain(t, "check", "--config", "../packaging/tandem.yaml"); code != 0 {
		t.Fatalf("packaging/tandem.yaml: exit %d %s %s", code, out, stderr)
	}
}

func TestRetentionAndFlushSettingsAccepted(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "tandem.yaml")
	os.WriteFile(cfg, []byte("storage:\n  max_bytes: 1GiB\n  max_age: 24h\n  flush: interval\n  flush_interval: 50ms\n"), 0o644)
	if code, out, stderr := runMain(t, "check", "--config", cfg); code != 0 {
		t.Fatalf("check: exit %d: %s%s", code, out, stderr)
	}
	os.WriteFile(cfg, []byte("storage:\n  max_bytes: 4MiB\n"), 0o644)
	if code, _, stderr := runMain(t, "check", "--config", cfg); code != ExitUsage || !strings.Contains(stderr, "storage.max_bytes") {
		t.Fatalf("a 4MiB budget: exit %d: %s", code, stderr)
	}
}
