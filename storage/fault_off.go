//go:build !tandem_nowalsync

package storage

import "os"

// walSync makes a WAL append durable. The build tag tandem_nowalsync
// replaces it with a deliberate fault (fault_nowalsync.go) for the
// power-cut rounds' test of themselves; this build is every other.
func walSync(f *os.File) error { return fdatasync(f) }
