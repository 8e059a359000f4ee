package powercut

import (
	"context"
	"path/filepath"
	"sort"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// node is the kernel's handle on an inode of the model. Several nodes may
// wrap one inode over time (the kernel forgets and looks up again); the
// model is the truth, as the backing filesystem is for a loopback.
type node struct {
	fs.Inode
	p  *FS
	in *inode
}

var (
	_ fs.NodeLookuper  = (*node)(nil)
	_ fs.NodeGetattrer = (*node)(nil)
	_ fs.NodeSetattrer = (*node)(nil)
	_ fs.NodeOpener    = (*node)(nil)
	_ fs.NodeCreater   = (*node)(nil)
	_ fs.NodeMkdirer   = (*node)(nil)
	_ fs.NodeUnlinker  = (*node)(nil)
	_ fs.NodeRmdirer   = (*node)(nil)
	_ fs.NodeRenamer   = (*node)(nil)
	_ fs.NodeReaddirer = (*node)(nil)
	_ fs.NodeReader    = (*node)(nil)
	_ fs.NodeWriter    = (*node)(nil)
	_ fs.NodeFsyncer   = (*node)(nil)
	_ fs.NodeFlusher   = (*node)(nil)
	_ fs.NodeStatfser  = (*node)(nil)
	_ fs.NodeAllocater = (*node)(nil)
	_ fs.NodeLinker    = (*node)(nil)
	_ fs.NodeSymlinker = (*node)(nil)
	_ fs.NodeMknoder   = (*node)(nil)
)

func (n *node) child(ctx context.Context, in *inode, out *fuse.EntryOut) *fs.Inode {
	fill(in, &out.Attr)
	mode := uint32(syscall.S_IFREG)
	if in.dir {
		mode = syscall.S_IFDIR
	}
	return n.NewInode(ctx, &node{p: n.p, in: in}, fs.StableAttr{Mode: mode, Ino: in.ino})
}

func fill(in *inode, a *fuse.Attr) {
	a.Ino = in.ino
	a.Mode = in.mode
	if in.dir {
		a.Mode |= syscall.S_IFDIR
		a.Nlink = 2
	} else {
		a.Mode |= syscall.S_IFREG
		a.Nlink = in.nlink
		a.Size = uint64(in.size)
		a.Blocks = (a.Size + 511) / 512
	}
	a.Blksize = 4096
	a.SetTimes(&in.mtime, &in.mtime, &in.mtime)
}

func (n *node) subPath(name string) string { return filepath.Join(n.in.path(), name) }

// Lookup finds name among the names the process sees.
func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	in := n.in.kids[name]
	if in == nil {
		return nil, syscall.ENOENT
	}
	return n.child(ctx, in, out), 0
}

// Getattr reports the size the process sees.
func (n *node) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	fill(n.in, &out.Attr)
	return 0
}

// Setattr truncates (unsynced, like a write) and sets mode and times
// (kept at once: not modelled).
func (n *node) Setattr(ctx context.Context, f fs.FileHandle, sa *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if sz, ok := sa.GetSize(); ok {
		if n.in.dir {
			return syscall.EISDIR
		}
		if e := n.p.check(Op{Kind: Truncate, Path: n.in.path(), Off: int64(sz)}); e != 0 {
			return e
		}
		n.p.truncate(n.in, int64(sz))
	} else if n.p.dead {
		return syscall.EIO
	}
	if m, ok := sa.GetMode(); ok {
		n.in.mode = m & 0o7777
	}
	if t, ok := sa.GetMTime(); ok {
		n.in.mtime = t
	}
	fill(n.in, &out.Attr)
	return 0
}

// Open honours O_TRUNC; the rest goes through the node.
func (n *node) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if flags&syscall.O_TRUNC != 0 && n.in.size > 0 {
		if e := n.p.check(Op{Kind: Truncate, Path: n.in.path()}); e != 0 {
			return nil, 0, e
		}
		n.p.truncate(n.in, 0)
	}
	return nil, 0, 0
}

// link adds in as name (unsynced); the caller holds the lock.
func (n *node) link(name string, in *inode) {
	in.parent, in.name = n.in, name
	in.nlink++
	n.in.kids[name] = in
	n.in.mtime = time.Now()
}

// Create makes a file whose name lasts only once the directory is synced.
func (n *node) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if e := n.p.check(Op{Kind: Create, Path: n.subPath(name)}); e != 0 {
		return nil, nil, 0, e
	}
	if n.in.kids[name] != nil {
		return nil, nil, 0, syscall.EEXIST
	}
	in, err := n.p.newFile(mode & 0o7777)
	if err != nil {
		return nil, nil, 0, syscall.EIO
	}
	n.link(name, in)
	return n.child(ctx, in, out), nil, 0, 0
}

// Mkdir makes a directory whose name lasts only once its parent is synced.
func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if e := n.p.check(Op{Kind: Create, Path: n.subPath(name)}); e != 0 {
		return nil, e
	}
	if n.in.kids[name] != nil {
		return nil, syscall.EEXIST
	}
	in := n.p.newInode(true, mode&0o7777)
	n.link(name, in)
	return n.child(ctx, in, out), 0
}

// Unlink removes a file's name (unsynced).
func (n *node) Unlink(ctx context.Context, name string) syscall.Errno { return n.remove(name, false) }

// Rmdir removes an empty directory's name (unsynced).
func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno { return n.remove(name, true) }

func (n *node) remove(name string, dir bool) syscall.Errno {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if e := n.p.check(Op{Kind: Create, Path: n.subPath(name)}); e != 0 {
		return e
	}
	in := n.in.kids[name]
	switch {
	case in == nil:
		return syscall.ENOENT
	case in.dir && !dir:
		return syscall.EISDIR
	case !in.dir && dir:
		return syscall.ENOTDIR
	case in.dir && len(in.kids) > 0:
		return syscall.ENOTEMPTY
	}
	if !in.dir {
		in.nlink--
	}
	delete(n.in.kids, name)
	n.in.mtime = time.Now()
	return 0
}

// Rename moves a name (unsynced in both directories), replacing what the
// new name held.
func (n *node) Rename(ctx context.Context, name string, newParent fs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if e := n.p.check(Op{Kind: Create, Path: n.subPath(name)}); e != 0 {
		return e
	}
	np, ok := newParent.(*node)
	if !ok || flags&^1 != 0 { // RENAME_NOREPLACE only; no RENAME_EXCHANGE
		return syscall.EINVAL
	}
	in := n.in.kids[name]
	if in == nil {
		return syscall.ENOENT
	}
	if old := np.in.kids[newName]; old != nil {
		switch {
		case old == in:
			return 0
		case flags&1 != 0:
			return syscall.EEXIST
		case old.dir != in.dir && old.dir:
			return syscall.EISDIR
		case old.dir != in.dir:
			return syscall.ENOTDIR
		case old.dir && len(old.kids) > 0:
			return syscall.ENOTEMPTY
		}
		if !old.dir {
			old.nlink--
		}
	}
	for d := np.in; d != nil; d = d.parent {
		if d == in {
			return syscall.EINVAL // into itself
		}
	}
	delete(n.in.kids, name)
	in.nlink--
	np.link(newName, in)
	return 0
}

// Readdir lists the names the process sees.
func (n *node) Readdir(ctx context.Context) (fs.DirStream, syscall.Errno) {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	ents := make([]fuse.DirEntry, 0, len(n.in.kids))
	for name, in := range n.in.kids {
		mode := uint32(syscall.S_IFREG)
		if in.dir {
			mode = syscall.S_IFDIR
		}
		ents = append(ents, fuse.DirEntry{Name: name, Mode: mode, Ino: in.ino})
	}
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name < ents[j].Name })
	return fs.NewListDirStream(ents), 0
}

// Read reads the view: durable content with the unsynced changes over it.
// After a cut it reads the view as it was then (so a process still running
// on the mount, the test itself with bbolt's mapping, does not fault),
// while everything that would change a file fails.
func (n *node) Read(ctx context.Context, f fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	k, err := n.p.read(n.in, dest, off)
	if err != nil {
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:k]), 0
}

// Write keeps the write in memory until the file is synced.
func (n *node) Write(ctx context.Context, f fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if e := n.p.check(Op{Kind: Write, Path: n.in.path(), Off: off, Len: len(data)}); e != 0 {
		return 0, e
	}
	n.p.write(n.in, data, off)
	if o := n.p.cutAfter; o != nil {
		n.p.cutAfter = nil
		n.p.cutLocked(o, true)
		return 0, syscall.EIO
	}
	return uint32(len(data)), 0
}

// Fsync makes a file's data or a directory's names durable (fsync and
// fdatasync alike: fdatasync keeps the size too, which reading needs).
func (n *node) Fsync(ctx context.Context, f fs.FileHandle, flags uint32) syscall.Errno {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if n.in.dir {
		if e := n.p.check(Op{Kind: DirSync, Path: n.in.path()}); e != 0 {
			return e
		}
		return n.p.syncDir(n.in)
	}
	if e := n.p.check(Op{Kind: Sync, Path: n.in.path()}); e != 0 {
		return e
	}
	return n.p.syncFile(n.in)
}

// Flush (close) makes nothing durable.
func (n *node) Flush(ctx context.Context, f fs.FileHandle) syscall.Errno { return 0 }

// Statfs reports the backing filesystem's space.
func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	var st syscall.Statfs_t
	if err := syscall.Statfs(n.p.backing, &st); err != nil {
		return fs.ToErrno(err)
	}
	out.FromStatfsT(&st)
	return 0
}

// Allocate is not modelled; posix_fallocate callers fall back to writes.
func (n *node) Allocate(ctx context.Context, f fs.FileHandle, off, size uint64, mode uint32) syscall.Errno {
	return syscall.EOPNOTSUPP
}

// Link is not modelled.
func (n *node) Link(ctx context.Context, target fs.InodeEmbedder, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Symlink is not modelled.
func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Mknod is not modelled.
func (n *node) Mknod(ctx context.Context, name string, mode, dev uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}
