//go:build !unix

package procs

import "time"

// processCPU cannot be read here: the governor does not run.
func processCPU() (time.Duration, bool) { return 0, false }
