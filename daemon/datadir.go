package daemon

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// checkDataDir makes sure this process may read and write the data dir,
// and read every file in it, before anything opens them. Without it a data dir
// of another user (tandem's, started by hand as someone else) surfaced
// as whatever read it first, and that blamed a missing file ("node.key
// and node.crt must both exist ...; restore the missing one") when both
// were there. The error says who runs the daemon and who owns the dir,
// which is the whole story of such a mistake.
func checkDataDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return accessError(dir, "read", err)
	}
	if err := unix.Access(dir, unix.R_OK|unix.W_OK|unix.X_OK); err != nil {
		return accessError(dir, "write", err)
	}
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue
		}
		p := filepath.Join(dir, e.Name())
		// Read only: some files are written once and kept read-only
		// (the key may be); the store's own files fail on open if
		// they cannot be written.
		if err := unix.Access(p, unix.R_OK); err != nil {
			return accessError(p, "read", err)
		}
	}
	return nil
}

// accessError words a permission error on path: "cannot read DIR:
// permission denied (runs as USER; the data dir belongs to OWNER)". Other
// errors are only given the path.
func accessError(path, verb string, err error) error {
	if !errors.Is(err, fs.ErrPermission) && !errors.Is(err, syscall.EROFS) {
		return fmt.Errorf("data dir: %w", err)
	}
	what := "the data dir"
	if fi, serr := os.Stat(path); serr == nil && !fi.IsDir() {
		what = filepath.Base(path)
	}
	reason := "permission denied"
	if errors.Is(err, syscall.EROFS) {
		reason = "read-only file system"
	}
	runs, owner := currentUser(), ownerOf(path)
	msg := fmt.Sprintf("cannot %s %s: %s (runs as %s; %s belongs to %s)", verb, path, reason, runs, what, owner)
	if owner != runs && reason == "permission denied" {
		msg += fmt.Sprintf(": run tandem as %s (the service does), or give it to %s (chown -R)", owner, runs)
	}
	return errors.New(msg)
}

// mkdirError words a failure to create the data dir the same way, naming
// the owner of the directory it was to be made in.
func mkdirError(dir string, err error) error {
	var pe *fs.PathError
	if !errors.Is(err, fs.ErrPermission) || !errors.As(err, &pe) {
		return fmt.Errorf("data dir: %w", err)
	}
	parent := filepath.Dir(pe.Path)
	return fmt.Errorf("cannot create %s: permission denied (runs as %s; %s belongs to %s)", dir, currentUser(), parent, ownerOf(parent))
}

// currentUser is the name this process runs as, or its uid.
func currentUser() string {
	uid := strconv.Itoa(os.Geteuid())
	if u, err := user.LookupId(uid); err == nil {
		return u.Username
	}
	return "uid " + uid
}

// ownerOf is the name of path's owner, or its uid, or "?" when path
// cannot be examined at all.
func ownerOf(path string) string {
	fi, err := os.Stat(path)
	if err != nil {
		return "?"
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return "?"
	}
	uid := strconv.FormatUint(uint64(st.Uid), 10)
	if u, err := user.LookupId(uid); err == nil {
		return u.Username
	}
	return "uid " + uid
}
