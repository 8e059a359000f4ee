package powercut

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// SectorSize is the unit a torn write keeps or loses: a disk writes a
// sector whole or not at all.
const SectorSize = 512

// ErrUnsupported is what Mount says when this machine cannot serve a FUSE
// filesystem (no /dev/fuse, or neither root nor fusermount3).
var ErrUnsupported = errors.New("powercut: FUSE is not available here")

// Kind is the kind of an operation a trigger sees.
type Kind int

// The operations a trigger sees.
const (
	Write    Kind = iota // a write to a file (not yet applied)
	Truncate             // a truncate of a file (not yet applied)
	Sync                 // an fsync or fdatasync of a file (not yet applied)
	DirSync              // an fsync of a directory (not yet applied)
	Create               // a create, mkdir, rename, unlink or rmdir
)

// String names the kind in reports.
func (k Kind) String() string {
	return [...]string{"write", "truncate", "sync", "dirsync", "create"}[k]
}

// Op is an operation about to be applied, as a trigger sees it.
type Op struct {
	Kind Kind
	Path string // relative to the mount, as the process currently names it
	Off  int64
	Len  int
}

// CutReport says what a Cut threw away.
type CutReport struct {
	Op        *Op      // the operation that triggered it (CutWhen), nil for Cut
	Writes    int      // unsynced writes and truncates dropped
	Names     int      // unsynced directory entries (new, renamed, removed) dropped
	NameList  []string // the first few of them, as paths
	Torn      string   // the write torn, "path@off+len kept N of M sectors"; "" if none
	Tore      bool     // a tear was asked for and a write could be torn
	ElapsedNS int64    // time the cut took under the lock
}

// Stats counts what passed through the filesystem.
type Stats struct {
	Writes, Syncs, DirSyncs uint64
}

// Options tune Mount.
type Options struct {
	// Seed drives the torn write of Cut(tear=true).
	Seed uint64
}

// FS is one mounted power-cut filesystem.
type FS struct {
	backing, scratch, mnt string
	server                *fuse.Server

	mu        sync.Mutex // guards everything below and every inode
	root      *inode
	nextIno   uint64
	seq       uint64 // order of the pending writes, for the torn one
	dead      bool   // cut: every operation fails
	rnd       *rand.Rand
	stats     Stats
	trigger   func(Op) bool // CutWhen's; nil when none
	tear      bool
	report    *CutReport
	cutDone   chan struct{} // closed by the cut
	unmounted bool
	cutAfter  *Op                  // a write to apply, then cut at (CutWhen with tear)
	lostFrom  map[string]time.Time // path → when the first change a cut dropped was made
}

// inode is a file or directory of the model.
type inode struct {
	ino    uint64
	dir    bool
	mode   uint32 // permission bits
	mtime  time.Time
	parent *inode // the last directory that named it, for Op.Path
	name   string

	kids  map[string]*inode // directories: the names the process sees
	dkids map[string]*inode // directories: the names as of their last fsync

	f     *os.File // files: scratch/<ino>, the durable content
	dsize int64    // durable size
	size  int64    // the size the process sees
	ops   []op     // unsynced writes and truncates, in order
	nlink uint32
}

// op is one unsynced change to a file's data.
type op struct {
	seq   uint64
	at    time.Time
	off   int64 // a truncate: the new size
	data  []byte
	trunc bool
}

// Available says whether this machine can mount a FUSE filesystem, and
// if not, why.
func Available() error {
	if _, err := os.Stat("/dev/fuse"); err != nil {
		return fmt.Errorf("%w: %v", ErrUnsupported, err)
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: not root", ErrUnsupported)
	}
	return nil
}

// Mount serves backing at mnt (both existing directories on one
// filesystem, mnt empty). A scratch directory for the inodes' durable
// content is made next to backing and removed by Cut and Unmount.
func Mount(backing, mnt string, opts *Options) (*FS, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	if opts == nil {
		opts = &Options{}
	}
	backing, err := filepath.Abs(backing)
	if err != nil {
		return nil, err
	}
	scratch, err := os.MkdirTemp(filepath.Dir(backing), ".powercut-scratch-")
	if err != nil {
		return nil, err
	}
	p := &FS{backing: backing, scratch: scratch, mnt: mnt, nextIno: 1, cutDone: make(chan struct{}), lostFrom: map[string]time.Time{},
		rnd: rand.New(rand.NewPCG(opts.Seed, opts.Seed^0x9e3779b97f4a7c15))}
	if p.root, err = p.load(backing); err != nil {
		os.RemoveAll(scratch)
		return nil, err
	}
	sec := time.Second
	srv, err := fs.Mount(mnt, &node{p: p, in: p.root}, &fs.Options{
		EntryTimeout: &sec, AttrTimeout: &sec, NegativeTimeout: &sec,
		MountOptions: fuse.MountOptions{FsName: "powercut", Name: "powercut", DirectMount: true, MaxBackground: 64},
	})
	if err != nil {
		p.closeFiles()
		os.RemoveAll(scratch)
		return nil, fmt.Errorf("powercut: mount %s: %w", mnt, err)
	}
	p.server = srv
	return p, nil
}

// load builds the model of what backing holds: all of it durable.
func (p *FS) load(backing string) (*inode, error) {
	byIno := map[uint64]*inode{}
	var walk func(path string, d *inode) error
	walk = func(path string, d *inode) error {
		ents, err := os.ReadDir(path)
		if err != nil {
			return err
		}
		for _, e := range ents {
			sub := filepath.Join(path, e.Name())
			fi, err := os.Lstat(sub)
			if err != nil {
				return err
			}
			st := fi.Sys().(*syscall.Stat_t)
			var in *inode
			switch {
			case fi.IsDir():
				in = p.newInode(true, uint32(fi.Mode().Perm()))
				if err := walk(sub, in); err != nil {
					return err
				}
			case fi.Mode().IsRegular():
				if in = byIno[st.Ino]; in == nil {
					in = p.newInode(false, uint32(fi.Mode().Perm()))
					if err := os.Link(sub, p.scratchPath(in)); err != nil {
						return err
					}
					if in.f, err = os.OpenFile(p.scratchPath(in), os.O_RDWR, 0); err != nil {
						return err
					}
					in.size, in.dsize = fi.Size(), fi.Size()
					byIno[st.Ino] = in
				}
			default:
				return fmt.Errorf("powercut: %s: only files and directories are supported", sub)
			}
			in.mtime, in.parent, in.name = fi.ModTime(), d, e.Name()
			in.nlink++
			d.kids[e.Name()], d.dkids[e.Name()] = in, in
		}
		return nil
	}
	root := p.newInode(true, 0o755)
	root.mtime = time.Now()
	return root, walk(backing, root)
}

func (p *FS) newInode(dir bool, mode uint32) *inode {
	p.nextIno++
	in := &inode{ino: p.nextIno, dir: dir, mode: mode, mtime: time.Now()}
	if dir {
		in.kids, in.dkids = map[string]*inode{}, map[string]*inode{}
	}
	return in
}

func (p *FS) scratchPath(in *inode) string {
	return filepath.Join(p.scratch, fmt.Sprint(in.ino))
}

// newFile makes a file inode with an empty scratch file.
func (p *FS) newFile(mode uint32) (*inode, error) {
	in := p.newInode(false, mode)
	f, err := os.OpenFile(p.scratchPath(in), os.O_RDWR|os.O_CREATE|os.O_EXCL, os.FileMode(mode)|0o600)
	if err != nil {
		return nil, err
	}
	in.f = f
	return in, nil
}

// path is in's name relative to the mount, as the process sees it now.
func (in *inode) path() string {
	var parts []string
	for n := in; n.parent != nil && len(parts) < 64; n = n.parent {
		parts = append(parts, n.name)
	}
	slices.Reverse(parts)
	return filepath.Join(parts...)
}

// Dir is the mount point.
func (p *FS) Dir() string { return p.mnt }

// Backing is the backing directory.
func (p *FS) Backing() string { return p.backing }

// Stats returns the counts so far.
func (p *FS) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

// CutWhen arms a trigger: the first operation for which when returns true
// cuts the power before it is applied (and fails with EIO) — except a write
// when tear is set: that one is applied first, so that it is the write the
// cut tears. when runs under the filesystem's lock and must not touch the
// mount. Done tells when it happened.
func (p *FS) CutWhen(when func(Op) bool, tear bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.trigger, p.tear = when, tear
}

// LostFrom returns when the earliest write or truncate that the cut dropped
// from a file whose path starts with prefix was made (zero if it dropped
// none, or before the cut): everything written to those files before that
// instant survived. The files' last fsync would not say that of a set of
// files synced one at a time: the fsync of one says nothing of the others.
func (p *FS) LostFrom(prefix string) time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	var first time.Time
	for path, at := range p.lostFrom {
		if strings.HasPrefix(path, prefix) && (first.IsZero() || at.Before(first)) {
			first = at
		}
	}
	return first
}

// Done is closed once the power is cut.
func (p *FS) Done() <-chan struct{} { return p.cutDone }

// Cut cuts the power now, unless it is already cut, and reports what it
// threw away (the first cut's report on later calls). tear keeps a prefix
// of whole sectors of the last unsynced write, chosen by the seed, as a
// disk that lost power in the middle of it would.
func (p *FS) Cut(tear bool) CutReport {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cutLocked(nil, tear)
	return *p.report
}

// Report is the report of the cut, nil before one.
func (p *FS) Report() *CutReport {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.report == nil {
		return nil
	}
	r := *p.report
	return &r
}

// check is called first by every operation, with p.mu held: it fails once
// the power is cut, and cuts it when the trigger says so.
func (p *FS) check(o Op) syscall.Errno {
	if !p.dead && p.trigger != nil && p.trigger(o) {
		if o.Kind == Write && p.tear {
			p.cutAfter = &o
			return 0
		}
		p.cutLocked(&o, p.tear)
	}
	if p.dead {
		return syscall.EIO
	}
	return 0
}

func (p *FS) cutLocked(o *Op, tear bool) {
	if p.dead {
		return
	}
	start := time.Now()
	p.dead = true
	r := &CutReport{Op: o}
	var last *inode
	var lastOp *op
	var walk func(d *inode, seen map[*inode]bool)
	walk = func(d *inode, seen map[*inode]bool) {
		if seen[d] {
			return
		}
		seen[d] = true
		note := func(name string) {
			r.Names++
			if len(r.NameList) < 8 {
				r.NameList = append(r.NameList, filepath.Join(d.path(), name))
			}
		}
		for name, in := range d.kids {
			if d.dkids[name] != in {
				note(name)
			}
		}
		for name := range d.dkids {
			if _, ok := d.kids[name]; !ok {
				note(name)
			}
		}
		kids := make([]*inode, 0, len(d.kids)+len(d.dkids))
		for _, in := range d.kids {
			kids = append(kids, in)
		}
		for _, in := range d.dkids {
			kids = append(kids, in)
		}
		for _, in := range kids {
			if in.dir {
				walk(in, seen)
				continue
			}
			if seen[in] {
				continue
			}
			seen[in] = true
			r.Writes += len(in.ops)
			if len(in.ops) > 0 {
				p.lostFrom[in.path()] = in.ops[0].at
			}
			for i := range in.ops {
				if lastOp == nil || in.ops[i].seq > lastOp.seq {
					last, lastOp = in, &in.ops[i]
				}
			}
		}
	}
	walk(p.root, map[*inode]bool{})
	if tear && lastOp != nil && !lastOp.trunc {
		// Sectors are aligned on the file's offsets, not on the write's.
		first := lastOp.off / SectorSize
		end := (lastOp.off + int64(len(lastOp.data)) + SectorSize - 1) / SectorSize
		if m := end - first; m >= 2 {
			k := 1 + p.rnd.Int64N(m-1)
			keep := (first+k)*SectorSize - lastOp.off
			_, _ = last.f.WriteAt(lastOp.data[:keep], lastOp.off)
			r.Tore = true
			r.Torn = fmt.Sprintf("%s@%d+%d kept %d of %d sectors", last.path(), lastOp.off, len(lastOp.data), k, m)
		}
	}
	// The scratch files stay open for reads of the frozen view until
	// Unmount; their names go now, so backing is what is left.
	_ = os.RemoveAll(p.scratch)
	r.ElapsedNS = time.Since(start).Nanoseconds()
	p.report = r
	close(p.cutDone)
}

// closeFiles closes every scratch file the model holds.
func (p *FS) closeFiles() {
	var walk func(d *inode, seen map[*inode]bool)
	walk = func(d *inode, seen map[*inode]bool) {
		for _, m := range []map[string]*inode{d.kids, d.dkids} {
			for _, in := range m {
				if seen[in] {
					continue
				}
				seen[in] = true
				if in.dir {
					walk(in, seen)
				} else if in.f != nil {
					in.f.Close()
				}
			}
		}
	}
	walk(p.root, map[*inode]bool{})
}

// Unmount takes the mount away (lazily if a process still holds it) and
// waits for the server to end, which is once every file open on the mount
// is closed (a killed process's are). Without a Cut first, the unsynced changes are
// lost just the same: that is a clean power-off, not a clean unmount.
func (p *FS) Unmount() error {
	p.Cut(false)
	p.mu.Lock()
	done := p.unmounted
	p.unmounted = true
	p.mu.Unlock()
	if done {
		return nil
	}
	t0 := time.Now()
	err := syscall.Unmount(p.mnt, 0)
	t1 := time.Now()
	detached := false
	if err != nil {
		// A process that still has a file open keeps it busy: detach.
		if lerr := syscall.Unmount(p.mnt, syscall.MNT_DETACH); lerr == nil {
			err = nil
			detached = true
		}
	}
	t2 := time.Now()
	// POWERCUT_DEBUG: say when the server takes long to end after the
	// umount (seen on a machine at load 30: up to 36 s, in 1 round of 25),
	// with the goroutines, to find what holds it.
	if os.Getenv("POWERCUT_DEBUG") != "" {
		tm := time.AfterFunc(2*time.Second, func() {
			buf := make([]byte, 1<<20)
			fmt.Fprintf(os.Stderr, "powercut: slow wait; goroutines:\n%s\n", buf[:runtime.Stack(buf, true)])
		})
		defer tm.Stop()
	}
	p.server.Wait()
	if os.Getenv("POWERCUT_DEBUG") != "" && time.Since(t0) > 500*time.Millisecond {
		fmt.Fprintf(os.Stderr, "powercut: unmount %s (umount %s, err %v, detached %v, wait %s)\n", time.Since(t0), t1.Sub(t0), err, detached, time.Since(t2))
	}
	p.mu.Lock()
	p.closeFiles()
	p.mu.Unlock()
	return err
}

// syncFile makes in's data durable: its writes and truncates reach the
// scratch file, in order.
func (p *FS) syncFile(in *inode) syscall.Errno {
	for _, o := range in.ops {
		var err error
		if o.trunc {
			err = in.f.Truncate(o.off)
		} else {
			_, err = in.f.WriteAt(o.data, o.off)
		}
		if err != nil {
			return syscall.EIO
		}
	}
	in.ops, in.dsize = nil, in.size
	p.stats.Syncs++
	return 0
}

// syncDir makes d's names durable: backing's copies of d gain the names
// that are new or changed and lose the ones that went.
func (p *FS) syncDir(d *inode) syscall.Errno {
	for _, dp := range p.dpaths(d) {
		for name, in := range d.dkids {
			if d.kids[name] != in {
				if err := os.RemoveAll(filepath.Join(dp, name)); err != nil {
					return syscall.EIO
				}
			}
		}
		for name, in := range d.kids {
			if d.dkids[name] != in {
				if err := p.materialize(filepath.Join(dp, name), in, 0); err != nil {
					return syscall.EIO
				}
			}
		}
	}
	d.dkids = make(map[string]*inode, len(d.kids))
	for name, in := range d.kids {
		d.dkids[name] = in
	}
	p.stats.DirSyncs++
	return 0
}

// dpaths lists where d is in backing: every durable path to it.
func (p *FS) dpaths(d *inode) []string {
	var out []string
	var walk func(at *inode, path string, depth int)
	walk = func(at *inode, path string, depth int) {
		if at == d {
			out = append(out, path)
			return
		}
		if depth > 64 {
			return
		}
		for name, in := range at.dkids {
			if in.dir {
				walk(in, filepath.Join(path, name), depth+1)
			}
		}
	}
	walk(p.root, p.backing, 0)
	return out
}

// materialize puts in at path in backing as the durable model has it: a
// file as a hard link to its durable content, a directory with its
// durable names.
func (p *FS) materialize(path string, in *inode, depth int) error {
	if !in.dir {
		return os.Link(p.scratchPath(in), path)
	}
	if depth > 64 {
		return errors.New("powercut: directories nested too deep")
	}
	if err := os.Mkdir(path, os.FileMode(in.mode)|0o700); err != nil {
		return err
	}
	for name, c := range in.dkids {
		if err := p.materialize(filepath.Join(path, name), c, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// write records an unsynced write.
func (p *FS) write(in *inode, data []byte, off int64) {
	p.seq++
	in.mtime = time.Now()
	in.ops = append(in.ops, op{seq: p.seq, at: in.mtime, off: off, data: append([]byte(nil), data...)})
	in.size = max(in.size, off+int64(len(data)))
	p.stats.Writes++
}

// truncate records an unsynced truncate.
func (p *FS) truncate(in *inode, size int64) {
	p.seq++
	in.mtime = time.Now()
	in.ops = append(in.ops, op{seq: p.seq, at: in.mtime, off: size, trunc: true})
	in.size = size
}

// read fills dest from off with what the process sees: the durable content
// with the unsynced changes over it. It returns the bytes read.
func (p *FS) read(in *inode, dest []byte, off int64) (int, error) {
	if off >= in.size {
		return 0, nil
	}
	n := int(min(int64(len(dest)), in.size-off))
	buf := dest[:n]
	clear(buf)
	if off < in.dsize {
		m := int(min(int64(n), in.dsize-off))
		if _, err := in.f.ReadAt(buf[:m], off); err != nil {
			return 0, err
		}
	}
	end := off + int64(n)
	for _, o := range in.ops {
		if o.trunc {
			if o.off < end {
				clear(buf[max(o.off-off, 0):])
			}
			continue
		}
		lo, hi := max(o.off, off), min(o.off+int64(len(o.data)), end)
		if lo < hi {
			copy(buf[lo-off:hi-off], o.data[lo-o.off:hi-o.off])
		}
	}
	return n, nil
}
