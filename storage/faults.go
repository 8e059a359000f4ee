package storage

import (
	"os"
	"sync/atomic"
	"syscall"
)

// faults are one DB's failpoints, in the manner of bbolt's gofail markers
// but per instance: tests in this package set them through Options.faults
// or on an open DB, so failing one DB's disk never touches another's or the
// process (as a package variable or RLIMIT_FSIZE did). In production they
// are all zero: one atomic load per checkpoint and per WAL growth.
type faults struct {
	// commit, when set, fails every checkpoint's bbolt transaction with
	// its error, as a full disk would.
	commit atomic.Pointer[error]
	// fileLimit, when above zero, fails a write that would grow a WAL
	// file past that many bytes with EFBIG, as RLIMIT_FSIZE would.
	fileLimit atomic.Int64
	// cutSync, when set, runs before the fdatasync of a cut frame written
	// without one (unsyncedCut): a test holds that sync there.
	cutSync atomic.Pointer[func()]
}

// commitErr is the error a checkpoint's transaction must fail with, or nil.
func (f *faults) commitErr() error {
	if err := f.commit.Load(); err != nil {
		return *err
	}
	return nil
}

// growErr is the error growing the file name to size bytes must fail
// with, or nil.
func (f *faults) growErr(name string, size int64) error {
	if lim := f.fileLimit.Load(); lim > 0 && size > lim {
		return &os.PathError{Op: "write", Path: name, Err: syscall.EFBIG}
	}
	return nil
}
