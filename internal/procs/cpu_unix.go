//go:build unix

package procs

import (
	"syscall"
	"time"
)

// processCPU is the CPU time of every thread of the process, user and
// system: what the kernel charges it, blocking waits excluded.
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
