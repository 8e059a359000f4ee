package version

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A build past a release reports it (0.1.0+N.gHASH) whether or not the
// release's tag came with the checkout: make build's describe string comes
// from packaging/describe.sh, which reads the releases from RELEASES too.
func TestBuildPastAReleaseNamesIt(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("SKIPPED: git not on PATH")
	}
	script, err := filepath.Abs("../../packaging/describe.sh")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	git := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"}, args...)...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return strings.TrimSpace(string(out))
	}
	describe := func() string {
		t.Helper()
		cmd := exec.Command("sh", script)
		cmd.Dir = dir
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("describe.sh: %v", err)
		}
		v, err := Debian(string(out))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	commit := func(file, text string) string {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, file), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		git("add", file)
		git("commit", "-q", "-m", file)
		return git("rev-parse", "HEAD")
	}
	git("init", "-q")
	release := commit("a", "1")
	short := func() string { return git("rev-parse", "--short", "HEAD") }
	if got, want := describe(), "0.0.0+git"+short(); got != want {
		t.Errorf("no release: %s, want %s", got, want)
	}
	commit("RELEASES", "v0.1.0 "+release+"\n")
	commit("b", "2")
	if got, want := describe(), "0.1.0+2.g"+short(); got != want {
		t.Errorf("2 commits past v0.1.0, untagged: %s, want %s", got, want)
	}
	if err := os.WriteFile(filepath.Join(dir, "b"), []byte("edited"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, want := describe(), "0.1.0+2.g"+short()+".dirty"; got != want {
		t.Errorf("edited: %s, want %s", got, want)
	}
	git("checkout", "-q", "b")
	// A newer release tagged before RELEASES lists it: the nearer wins.
	git("tag", "v0.2.0")
	if got := describe(); got != "0.2.0" {
		t.Errorf("at tag v0.2.0: %s, want 0.2.0", got)
	}
	commit("c", "3")
	if got, want := describe(), "0.2.0+1.g"+short(); got != want {
		t.Errorf("1 commit past tag v0.2.0: %s, want %s", got, want)
	}
}

// RELEASES is well formed: a vX.Y.Z and a full commit hash a line (the
// upgrade test builds the last one from git history).
func TestReleasesFile(t *testing.T) {
	b, err := os.ReadFile("../../RELEASES")
	if err != nil {
		t.Fatal(err)
	}
	for i, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 || !strings.HasPrefix(f[0], "v") || len(f[1]) != 40 || strings.Trim(f[1], "0123456789abcdef") != "" {
			t.Errorf("RELEASES line %d: %q: want \"vX.Y.Z <40-hex commit>\"", i+1, line)
			continue
		}
		if v, err := Debian(f[0]); err != nil || strings.Contains(v, "+") {
			t.Errorf("RELEASES line %d: %q is not a release version (%v)", i+1, f[0], err)
		}
	}
}
