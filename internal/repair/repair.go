// Package repair is `tandem repair --data DIR`: for a lone gateway whose
// data dir fails its checks at start, it copies what can be read into new
// files (storage.Repair), keeps the damaged ones in a timestamped folder
// inside the data dir, puts the new ones where `tandem run` looks, and says
// what it did and what was lost, in lines a field engineer reads on site.
//
// It refuses a data dir a running gateway holds (the data file's lock, the
// one `tandem inspect` meets), and a healthy one. The damaged files are
// never changed or deleted: they are hard-linked (on a filesystem without
// links: copied) into the folder before the new ones are renamed over them, so a crash at any point leaves either
// the old files or the new ones in place, never none.
package repair

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// ErrHealthy is returned for a data dir that passes its checks: there is
// nothing to repair, and nothing was changed.
var ErrHealthy = errors.New("the data dir passes its checks: nothing to repair")

// ErrInUse is storage.ErrInUse: a running gateway holds the data dir.
var ErrInUse = storage.ErrInUse

// Options are repair's flags.
type Options struct {
	// Force repairs a dir that passes its checks, or one of a cluster
	// member, too.
	Force bool
	// AcceptIncomplete accepts a broker state marked incomplete as it is
	// and clears the mark (storage.RepairOptions.AcceptIncomplete); a
	// dir that passes its checks is copied for it without Force.
	AcceptIncomplete bool
	// Now names the folder the damaged files move to; nil means time.Now.
	Now func() time.Time
}

// Run repairs the data dir dir and writes what it does to w.
func Run(w io.Writer, dir string, opts Options) error {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	db := filepath.Join(dir, storage.FileName)
	if _, err := os.Stat(db); err != nil {
		return fmt.Errorf("%s: no data file here (%w): is this a tandem data dir?", dir, err)
	}
	unlock, err := lockShared(db)
	if err != nil {
		return err
	}
	defer unlock()

	check := storage.Verify(dir)
	switch {
	case errors.Is(check, storage.ErrInUse):
		return fmt.Errorf("%s: %w", dir, check)
	case check == nil && opts.AcceptIncomplete:
		fmt.Fprintf(w, "%s passes every check a start makes; accepting its broker state as it is (--accept-incomplete).\n", dir)
	case check == nil && !opts.Force:
		fmt.Fprintf(w, "%s passes every check a start makes: nothing to repair, nothing changed.\n", dir)
		return ErrHealthy
	case check == nil:
		fmt.Fprintf(w, "%s passes every check a start makes; copying it anyway (--force).\n", dir)
	default:
		fmt.Fprintf(w, "%s fails its checks:\n  %v\n", dir, check)
	}

	stamp := opts.Now().UTC().Format("20060102T150405Z")
	tmp := filepath.Join(dir, ".repair-"+stamp)
	if err := os.Mkdir(tmp, 0o750); err != nil {
		return fmt.Errorf("repair: %w", err)
	}
	defer os.RemoveAll(tmp) // only the new files, and only if they were not moved in
	rep, err := storage.Repair(dir, tmp, &storage.RepairOptions{NodeID: nodeID(dir), AllowCluster: opts.Force, AcceptIncomplete: opts.AcceptIncomplete})
	switch {
	case errors.Is(err, storage.ErrNotIncomplete):
		return fmt.Errorf("%s: %w; nothing was changed", dir, err)
	case errors.Is(err, storage.ErrClusterMember) && opts.AcceptIncomplete:
		return fmt.Errorf("%s: %w.\nIts master sends it a whole snapshot once both run: start the master again. Only if no member of its cluster will ever come back, use --force to accept its broker state as it is; then `tandem promote` makes it the master", dir, err)
	}
	if errors.Is(err, storage.ErrClusterMember) {
		return fmt.Errorf("%s: %w.\nOn a cluster member, start the gateway with storage.on_damage: resync: it moves the damaged files aside and re-syncs from its peers. Use --force to repair it as a lone gateway anyway", dir, err)
	}
	if err != nil {
		return fmt.Errorf("repair: %w; nothing was changed in %s", err, dir)
	}

	kept := filepath.Join(dir, "damaged", stamp) // where a re-syncing member keeps its damaged files too
	if err := swap(dir, tmp, kept); err != nil {
		return err
	}
	report(w, dir, kept, rep, check == nil)
	return nil
}

// nodeID is the id of the node's key, 0 when there is none to read (the
// repair then keeps the data file's own).
func nodeID(dir string) uint64 {
	for _, f := range []string{replication.KeyFile, replication.CertFile} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			return 0 // LoadOrCreateIdentity would make a new key
		}
	}
	id, err := replication.LoadOrCreateIdentity(dir)
	if err != nil {
		return 0
	}
	return id.ID
}

// lockShared takes a shared lock on the data file, as bbolt's read-only
// open does: a running gateway holds it exclusively, so this fails at once
// (ErrInUse), and a gateway started during the repair cannot take it.
func lockShared(path string) (func(), error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("repair: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%s: %w: stop the gateway first (systemctl stop tandem); tandem repair never touches a running gateway's files", filepath.Dir(path), storage.ErrInUse)
		}
		return nil, fmt.Errorf("repair: lock %s: %w", path, err)
	}
	return func() { f.Close() }, nil
}

// renameFile is os.Rename; a test cuts a swap short with it.
var renameFile = os.Rename

// swap keeps the damaged store files in kept (hard links: the originals,
// byte for byte) and moves the new ones from tmp into dir, then removes the
// damaged ones the repair has no file of (format 6's segments). The node's
// key, certificate and API token stay. The order makes a swap cut short
// anywhere leave the damaged data file with all of its own files, or the
// repaired one with all of its: first the repaired files whose names the
// damaged dir does not use (format 6's segments: a repaired chain starts
// past the damaged one), then the data file, then those whose names it
// does use (format 5's two WAL files, which the new data file's WAL id
// disowns until they are in place).
func swap(dir, tmp, kept string) error {
	if err := os.MkdirAll(filepath.Dir(kept), 0o750); err != nil {
		return fmt.Errorf("repair: %w; nothing was changed in %s", err, dir)
	}
	if err := os.Mkdir(kept, 0o750); err != nil {
		return fmt.Errorf("repair: %w; nothing was changed in %s", err, dir)
	}
	old, err := storage.Files(dir)
	if err != nil {
		return fmt.Errorf("repair: %w; nothing was changed in %s", err, dir)
	}
	repaired, err := storage.Files(tmp)
	if err != nil {
		return fmt.Errorf("repair: %w; nothing was changed in %s", err, dir)
	}
	for _, name := range old {
		if err := keep(filepath.Join(dir, name), filepath.Join(kept, name)); err != nil {
			return fmt.Errorf("repair: keeping %s in %s: %w; nothing was changed in %s", name, kept, err, dir)
		}
	}
	if err := syncDir(kept); err != nil {
		return err
	}
	var fresh, shared []string
	for _, name := range repaired {
		switch {
		case name == storage.FileName:
		case slices.Contains(old, name):
			shared = append(shared, name)
		default:
			fresh = append(fresh, name)
		}
	}
	move := func(names ...string) error {
		for _, name := range names {
			src, dst := filepath.Join(tmp, name), filepath.Join(dir, name)
			chownLike(src, dst)
			if err := renameFile(src, dst); err != nil {
				return fmt.Errorf("repair: moving the repaired %s into %s: %w (the damaged files are kept in %s)", name, dir, err, kept)
			}
		}
		return syncDir(dir)
	}
	if err := move(fresh...); err != nil {
		return err
	}
	if err := move(storage.FileName); err != nil {
		return err
	}
	if err := move(shared...); err != nil {
		return err
	}
	for _, n := range old {
		if !slices.Contains(repaired, n) {
			if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("repair: removing the damaged %s (kept in %s): %w", n, kept, err)
			}
		}
	}
	return syncDir(dir)
}

// keep makes dst the file src: a hard link, or a copy (synced) on a
// filesystem without them (vfat).
func keep(src, dst string) error {
	err := os.Link(src, dst)
	if err == nil || !(errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.ENOTSUP) || errors.Is(err, syscall.EXDEV)) {
		return err
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// chownLike gives the new file src the owner of the file it replaces, so
// that a repair run as root leaves files the service's user can open.
func chownLike(src, like string) {
	fi, err := os.Stat(like)
	if err != nil {
		fi, err = os.Stat(filepath.Dir(like))
	}
	if err != nil {
		return
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && os.Geteuid() == 0 {
		_ = os.Chown(src, int(st.Uid), int(st.Gid))
	}
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("repair: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("repair: sync %s: %w", dir, err)
	}
	return nil
}

// report says what the repair did, one fact a line; healthy when the dir
// passed its checks (copied for --force or --accept-incomplete).
func report(w io.Writer, dir, kept string, rep *storage.RepairReport, healthy bool) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format+"\n", a...) }
	if rep.Last >= rep.First {
		p("Copied %d log entries (%d records) of index %d to %d, and %d WAL frames.", rep.Entries, rep.Records, rep.First, rep.Last, rep.WALFrames)
	} else {
		p("The log is empty: no entry could be copied.")
	}
	for _, n := range rep.Notes {
		p("%s", n)
	}
	switch {
	case len(rep.Lost) == 0 && rep.EndKnown:
		p("Lost records: none.")
	case len(rep.Lost) == 0:
		p("Lost records: none found; the data file's commit index could not be read, so records after index %d may be missing unseen.", rep.Last)
	}
	for _, l := range rep.Lost {
		if n := l.To - l.From + 1; n == 1 {
			p("LOST: %s (its entry could not be read; it is an empty entry in the repaired log).", l)
		} else {
			p("LOST: %s (%d entries could not be read; they are empty entries in the repaired log).", l, n)
		}
	}
	for _, u := range rep.Unreadable {
		p("LOST: could not read %s.", u)
	}
	var keys []string
	for _, b := range []string{storage.BucketSessions, "uplinks", storage.BucketMembers, "meta"} {
		keys = append(keys, fmt.Sprintf("%s %d", b, rep.Keys[b]))
	}
	var other []string
	for b := range rep.Keys {
		switch b {
		case storage.BucketSessions, "uplinks", storage.BucketMembers, "meta":
		default:
			other = append(other, b)
		}
	}
	sort.Strings(other)
	for _, b := range other {
		keys = append(keys, fmt.Sprintf("%s %d", b, rep.Keys[b]))
	}
	p("Broker state copied (keys per bucket): %s; applied index %d.", strings.Join(keys, ", "), rep.Applied)
	if healthy {
		p("The files as they were are kept, unchanged, in %s.", kept)
	} else {
		p("The damaged files are kept, unchanged, in %s.", kept)
	}
	p("The repaired files are in %s: start the gateway as usual (systemctl start tandem, or tandem run --data %s).", dir, dir)
}
