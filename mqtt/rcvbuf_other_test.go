//go:build !unix

package mqtt

// setRcvBuf leaves the receive buffer as it is where sockets are not file
// descriptors.
func setRcvBuf(fd uintptr, n int) error { return nil }
