//go:build unix

package mqtt

import "syscall"

// setRcvBuf asks for a socket receive buffer of n bytes.
func setRcvBuf(fd uintptr, n int) error {
	return syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, n)
}
