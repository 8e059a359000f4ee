//go:build !unix

package bench

// RaiseFileLimit does nothing where there is no RLIMIT_NOFILE.
func RaiseFileLimit(need uint64) error { return nil }
