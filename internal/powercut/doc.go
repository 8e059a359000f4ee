// Package powercut is a FUSE filesystem for tests that shows what a power
// cut leaves of a directory, as LazyFS does for Jepsen.
//
// Mount(backing, mnt) serves the files of the directory backing at mnt.
// Every change made through mnt that nothing has made durable yet stays in
// memory: a write or truncate until an fsync or fdatasync of its file, a
// create, mkdir, rename, unlink or rmdir until an fsync of the directory
// that holds the name. Reads see everything (the unsynced changes over what
// is durable), so the program under test works as on any filesystem. The
// backing directory only ever holds the durable state: on Cut every unsynced
// change is thrown away (optionally tearing the last unsynced write at a
// 512-byte sector boundary) and every later change fails with EIO (reads
// still see the view of that instant), so
// once the mount is gone backing holds exactly what a power cut at that
// instant would have left, ready to start the program again on.
//
// The model is the strict POSIX one, stricter than ext4's (where an fsync
// commits the whole journal, every earlier rename with it): a new name
// survives only once its directory was fsynced, a file's data only once the
// file was. A file's durable data lives in a scratch file next to backing
// (an inode's content is independent of its names); the names a
// directory fsync makes durable are hard links to it in backing.
//
// Not modelled: permissions and times are kept as they are set (not
// dropped at a cut); hard links, symlinks, device nodes, xattrs and
// fallocate are refused. Shared read mmap works (bbolt reads its file
// through one): the mount uses the kernel's page cache, not direct I/O,
// and writes go through to this process at once (no writeback cache), so
// the page cache always agrees with the view. A writable shared mapping
// would reach the filesystem only at the kernel's writeback, at times
// nobody controls; bbolt does not use one. Map a file of the mount only in
// another process than the one serving it: a Go process faulting on a
// mapping it serves itself deadlocks with its garbage collector (the
// faulting thread cannot be stopped, the serving ones already are).
//
// Threading: one mutex guards the whole model, so operations are serialised
// and a Cut falls between two of them.
package powercut
