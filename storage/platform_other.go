//go:build !linux

package storage

import "os"

// unmapPages is a no-op off Linux.
func unmapPages(uintptr, uintptr) {}

// adviseSequential is a no-op off Linux.
func adviseSequential(uintptr, uintptr) {}

// fdatasync is a full fsync where fdatasync does not exist.
func fdatasync(f *os.File) error { return f.Sync() }

// statfs is unknown off Linux: the free-space watermark is off there.
var statfs func(dir string) (free, total int64, err error)
