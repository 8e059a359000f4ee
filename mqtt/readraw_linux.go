//go:build linux

package mqtt

import (
	"net"
	"syscall"
)

// rawConn returns c's socket for loopRaw, or nil for read's path.
func (c *conn) rawConn() syscall.RawConn {
	tc, ok := c.nc.(*net.TCPConn)
	if !ok || !c.authed {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// fill reads once from fd: into the body of the packet being read and the
// buffer after it, or into the buffer. It returns what was read.
func (in *inBuf) fill(fd int) (n int, err error) {
	if in.buf == nil {
		in.buf = readBufs.Get().(*[readBufSize]byte)
	}
	if in.r > 0 {
		// What is left is the start of a header (next): to the front.
		in.w = int32(copy(in.buf[:], in.buf[in.r:in.w]))
		in.r = 0
	}
	if in.nPart > 0 {
		// Only when the buffer was empty (park): it goes in front.
		in.w = int32(copy(in.buf[:], in.part[:in.nPart]))
		in.nPart = 0
	}
	free := in.buf[in.w:]
	if in.pend != nil {
		rest := in.pend[len(in.pend):cap(in.pend)]
		n, err = sysReadv(fd, rest, free)
		if n > 0 {
			k := min(n, len(rest))
			in.pend = in.pend[:len(in.pend)+k]
			in.w += int32(n - k)
		}
		return max(n, 0), err
	}
	n, err = sysRead(fd, free)
	if n > 0 {
		in.w += int32(n)
	}
	return max(n, 0), err
}
