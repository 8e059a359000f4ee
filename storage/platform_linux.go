package storage

import (
	"os"

	"golang.org/x/sys/unix"
)

// startWriteback asks the kernel to start writing [off, off+n) of f to disk
// now, without waiting for it.
func startWriteback(f *os.File, off, n int64) {
	_ = unix.SyncFileRange(int(f.Fd()), off, n, unix.SYNC_FILE_RANGE_WRITE)
}

// unmapPages drops the process's page-table entries for [addr, addr+n) of a
// shared file mapping. The pages stay in the page cache, and the next access
// maps them again with the file's current contents.
func unmapPages(addr, n uintptr) {
	_, _, _ = unix.Syscall(unix.SYS_MADVISE, addr, n, unix.MADV_DONTNEED)
}
