//go:build tandem_nowalsync

package storage

import "os"

// walSync is the deliberate fault of the power-cut rounds' own test (build
// tag tandem_nowalsync, never in a release): a WAL append skips its
// fdatasync and is acked as if it had been made durable. A power cut then
// loses acked records, and the rounds must say so.
func walSync(*os.File) error { return nil }
