package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// `tandem check` refuses what `tandem run` refuses, and says everything
// at once: a config with an unknown key, a bad value, two listeners on one
// port and users and ACL files that do not exist gets every one of them,
// each with its line and key, from check and from run alike; run touches
// no data dir; with the mistakes fixed, check says ok.
func TestCheckReportsWhatRunRefusesAllAtOnce(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	const bad = `node:
  data_dir: %DATA%
mqtt:
  listen: "127.0.0.1:18999"
  users_file: %DIR%/missing.users
  acl_file: %DIR%/missing.acl
  listn: "typo"
http:
  listen: "127.0.0.1:18999"
cluster:
  failover: sometimes
`
	path := filepath.Join(dir, "tandem.yaml")
	text := strings.NewReplacer("%DATA%", data, "%DIR%", dir).Replace(bad)
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"tandem.yaml:7: unknown key \"mqtt.listn\"",
		"tandem.yaml:11: cluster.failover:",
		"tandem.yaml:9: http.listen:",
		"tandem.yaml:5: mqtt.users_file:",
		"tandem.yaml:6: mqtt.acl_file:",
	}
	for _, cmd := range []string{"check", "run"} {
		code, _, stderr := runMain(t, cmd, "--config", path)
		if code != ExitUsage {
			t.Fatalf("%s: exit %d, want 2\n%s", cmd, code, stderr)
		}
		for _, w := range want {
			if !strings.Contains(stderr, w) {
				t.Errorf("%s does not report %q:\n%s", cmd, w, stderr)
			}
		}
		if n := strings.Count(stderr, "\n"); n != len(want) {
			t.Errorf("%s: %d lines, want one per error (%d):\n%s", cmd, n, len(want), stderr)
		}
	}
	if _, err := os.Stat(data); !os.IsNotExist(err) {
		t.Errorf("run with a bad config touched the data dir: %v", err)
	}

	os.WriteFile(filepath.Join(dir, "missing.users"), nil, 0o600)
	os.WriteFile(filepath.Join(dir, "missing.acl"), nil, 0o600)
	good := strings.NewReplacer("  listn: \"typo\"\n", "", "\"127.0.0.1:18999\"\ncluster", "\"127.0.0.1:0\"\ncluster", "sometimes", "manual").Replace(text)
	os.WriteFile(path, []byte(good), 0o600)
	if code, out, stderr := runMain(t, "check", "--config", path); code != ExitOK || !strings.Contains(out, "ok") {
		t.Fatalf("fixed config: exit %d %s %s", code, out, stderr)
	}
}
