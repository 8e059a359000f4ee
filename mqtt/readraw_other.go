//go:build !linux

package mqtt

import (
	"errors"
	"syscall"
)

// rawConn: loopRaw reads Linux sockets only (readraw_linux.go); elsewhere
// every connection takes read's path.
func (c *conn) rawConn() syscall.RawConn { return nil }

// fill is never called where rawConn is nil.
func (in *inBuf) fill(fd int) (n int, err error) {
	return 0, errors.ErrUnsupported
}
