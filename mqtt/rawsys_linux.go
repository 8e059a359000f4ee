//go:build linux && !race

package mqtt

import (
	"syscall"
	"unsafe"
)

// The read loop's reads and the inline ack writes are raw system calls,
// without the runtime's syscall entry and exit. On a non-blocking socket
// they never block, so the Go processor never needs handing off; and with
// one processor (procs' governor), the entry of every first call after
// the processor idled woke the runtime's sysmon thread, which then polled
// every 20 µs until the processor idled again. Under W1's load that
// thread took about a tenth of the gateway's CPU. Race builds keep the
// syscall package's calls (rawsys_race.go).

// sysRead is read(2) on the non-blocking socket fd.
func sysRead(fd int, p []byte) (int, error) {
	n, _, e := syscall.RawSyscall(syscall.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(len(p)))
	if e != 0 {
		return -1, e
	}
	return int(n), nil
}

// sysReadv is readv(2) into a, then b, on the non-blocking socket fd.
func sysReadv(fd int, a, b []byte) (int, error) {
	var iov [2]syscall.Iovec
	iov[0].Base, iov[1].Base = unsafe.SliceData(a), unsafe.SliceData(b)
	iov[0].SetLen(len(a))
	iov[1].SetLen(len(b))
	n, _, e := syscall.RawSyscall(syscall.SYS_READV, uintptr(fd), uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
	if e != 0 {
		return -1, e
	}
	return int(n), nil
}

// writeOnce writes b to the non-blocking socket fd once (again only if a
// signal cut it short) and returns what went, 0 for nothing: EAGAIN, a
// full socket buffer, or an error, which the writer's own write meets.
func writeOnce(fd uintptr, b []byte) int {
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			return 0
		}
		return int(n)
	}
}
