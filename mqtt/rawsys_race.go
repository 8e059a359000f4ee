//go:build linux && race

package mqtt

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// Under the race detector the socket calls are the syscall package's,
// not raw ones (rawsys_linux.go): the detector takes every read after a
// write as ordered after it (syscall's ioSync), which is how it sees the
// order a peer imposes (a PUBLISH encoded and written, then its PUBACK
// read and handled). Raw calls would hide that order, and the detector
// would report such pairs as races. writeOnce is rawwrite_unix.go's.

// sysRead is read(2) on the non-blocking socket fd.
func sysRead(fd int, p []byte) (int, error) { return syscall.Read(fd, p) }

// sysReadv is readv(2) into a, then b, on the non-blocking socket fd.
func sysReadv(fd int, a, b []byte) (int, error) { return unix.Readv(fd, [][]byte{a, b}) }
