//go:build unix

package bench

import (
	"fmt"
	"syscall"
)

// RaiseFileLimit makes sure this process may hold need open files: it
// raises the soft RLIMIT_NOFILE to the hard limit, and the hard limit too
// when that is lower and the process may (root). Processes started after
// it inherit the raised limit (Go gives its children the original soft
// limit only when the program never set the limit itself), which is how
// bench/suite hands a broker under test enough descriptors.
func RaiseFileLimit(need uint64) error {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return nil // nothing to go by: let the connections find out
	}
	if l.Cur >= need {
		return nil
	}
	want := l
	want.Max = max(l.Max, need)
	want.Cur = want.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err == nil {
		return nil
	}
	if l.Max >= need {
		want.Max, want.Cur = l.Max, l.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err == nil {
			return nil
		}
	}
	return fmt.Errorf("bench: the connections need %d open files and the limit is %d (hard %d): raise it (ulimit -n)", need, l.Cur, l.Max)
}
