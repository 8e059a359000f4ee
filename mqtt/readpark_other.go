//go:build !linux

package mqtt

import "time"

// idler: connections park on Linux only (readpark_linux.go).
type idler struct{}

func (s *Server) parking() *idler { return nil }

func (d *idler) park(c *conn, fd int, by time.Time) bool { return false }

func (d *idler) unpark(c *conn) {}
