package storage

import (
	"os"

	"golang.org/x/sys/unix"
)

// unmapPages drops the process's page-table entries for [addr, addr+n) of a
// shared file mapping. The pages stay in the page cache, and the next access
// maps them again with the file's current contents.
func unmapPages(addr, n uintptr) {
	_, _, _ = unix.Syscall(unix.SYS_MADVISE, addr, n, unix.MADV_DONTNEED)
}

// adviseSequential tells the kernel that the n bytes mapped at addr are
// about to be read in order: readahead then fetches them in large reads,
// where bbolt's MADV_RANDOM would fault them in a page at a time.
func adviseSequential(addr, n uintptr) {
	_, _, _ = unix.Syscall(unix.SYS_MADVISE, addr, n, unix.MADV_SEQUENTIAL)
}

// fdatasync flushes f's data (and the metadata needed to read it back) to
// the device, not its timestamps: what bbolt does too.
func fdatasync(f *os.File) error {
	for {
		err := unix.Fdatasync(int(f.Fd()))
		if err != unix.EINTR {
			return err
		}
	}
}

// statfs returns the bytes free to unprivileged users and the size of the
// filesystem holding dir.
func statfs(dir string) (free, total int64, err error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return 0, 0, err
	}
	// Bsize is an int32 on 32-bit ARM: convert it too, or armv7 does not build.
	return int64(fs.Bavail) * int64(fs.Bsize), int64(fs.Blocks) * int64(fs.Bsize), nil
}
