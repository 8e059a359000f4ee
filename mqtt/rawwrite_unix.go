//go:build unix && (!linux || race)

package mqtt

import "syscall"

// writeOnce writes b to the non-blocking socket fd once (again only if a
// signal cut it short) and returns what went, 0 for nothing: EAGAIN, a
// full socket buffer, or an error, which the writer's own write meets.
func writeOnce(fd uintptr, b []byte) int {
	for {
		n, err := syscall.Write(int(fd), b)
		if err == syscall.EINTR {
			continue
		}
		return max(n, 0)
	}
}
