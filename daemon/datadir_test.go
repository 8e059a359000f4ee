package daemon

import (
	"context"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A data dir the daemon may not read is reported as that, with who runs
// it and who owns the dir, not as a missing node.key. As root (CI) the
// gateway runs as nobody, so that the permissions bite; as another user
// the test takes the permissions away from itself.
func TestUnreadableDataDirSaysWhoRunsAndWhoOwns(t *testing.T) {
	base, err := os.MkdirTemp("", "tandem-perm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Chmod(base, 0o700); os.RemoveAll(base) })
	if err := os.Chmod(base, 0o755); err != nil { // nobody must reach what is inside
		t.Fatal(err)
	}
	me := currentUser()

	// An existing gateway's data dir, mode 0700, of the user running
	// the tests; and one whose dir is open but whose key is not.
	closed := filepath.Join(base, "closed")
	d := testGateway(t, closed, nil)
	d.Stop()
	if err := os.Chmod(closed, 0o700); err != nil {
		t.Fatal(err)
	}
	keyOnly := filepath.Join(base, "key")
	if err := os.Mkdir(keyOnly, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(keyOnly, 0o777); err != nil { // past the umask
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(keyOnly, "node.key"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}

	run := func(dir string) (int, string, string) {
		args := []string{"run", "--data", dir, "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0", "--peer", "127.0.0.1:0"}
		if os.Geteuid() != 0 {
			code, _, stderr := runMain(t, args...)
			return code, stderr, me
		}
		nobody, err := user.Lookup("nobody")
		if err != nil {
			t.Fatalf("running as root, the test needs the user nobody: %v", err)
		}
		uid, _ := strconv.Atoi(nobody.Uid)
		gid, _ := strconv.Atoi(nobody.Gid)
		bin := filepath.Join(base, "tandem") // where nobody may run it
		if _, err := os.Stat(bin); err != nil {
			if out, err := exec.Command("go", "build", "-o", bin, "github.com/tandem-edge/tandem").CombinedOutput(); err != nil {
				t.Fatalf("go build: %v\n%s", err, out)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Dir = base
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
		var stderr strings.Builder
		cmd.Stderr = &stderr
		err = cmd.Run()
		code := cmd.ProcessState.ExitCode()
		if err != nil && code <= 0 {
			t.Fatalf("tandem run as nobody: %v", err)
		}
		return code, stderr.String(), "nobody"
	}
	if os.Geteuid() != 0 {
		// Not root: take the access away from ourselves instead.
		os.Chmod(closed, 0o000)
		os.Chmod(filepath.Join(keyOnly, "node.key"), 0o000)
		t.Cleanup(func() { os.Chmod(closed, 0o700) })
	}

	code, stderr, runs := run(closed)
	want := "cannot read " + closed + ": permission denied (runs as " + runs + "; the data dir belongs to " + me + ")"
	if code == 0 || !strings.Contains(stderr, want) || strings.Contains(stderr, "must both exist") {
		t.Errorf("unreadable data dir: exit %d, stderr %q\nwant it to contain %q", code, stderr, want)
	}
	code, stderr, runs = run(keyOnly)
	want = "cannot read " + filepath.Join(keyOnly, "node.key") + ": permission denied (runs as " + runs + "; node.key belongs to " + me + ")"
	if code == 0 || !strings.Contains(stderr, want) {
		t.Errorf("unreadable key: exit %d, stderr %q\nwant it to contain %q", code, stderr, want)
	}
}
