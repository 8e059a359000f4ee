package storage

import "errors"

// Sentinel errors returned by this package. Callers test them with errors.Is;
// the returned errors wrap them with the index, key or path involved.
var (
	// ErrCompacted is returned by Entries and Term for an index that has been
	// compacted away. It is raft.ErrCompacted, so raft recognises it.
	ErrCompacted = errCompacted

	// ErrUnavailable is returned by Entries and Term for an index past the
	// last one in the log. It is raft.ErrUnavailable.
	ErrUnavailable = errUnavailable

	// ErrCorrupt reports a data file or record that fails its checks: a CRC
	// mismatch, a torn or truncated file, a broken bucket. The file is left
	// as it is; the daemon refuses to start.
	ErrCorrupt = errors.New("corrupt data file")

	// ErrInUse reports a data file locked by another process.
	ErrInUse = errors.New("data dir in use by another process (is another tandem running?)")

	// ErrNotCheckpointed is returned by Close when the WAL could not be
	// checkpointed into the data file (a full disk): nothing is lost, the
	// WAL keeps those entries and the next Open replays them.
	ErrNotCheckpointed = errors.New("storage: the WAL could not be checkpointed into the data file; it keeps its entries for the next start")

	// ErrClosed is returned by any operation on a closed DB.
	ErrClosed = errors.New("storage: closed")

	// ErrUnknownVersion is returned when a record or a data file carries a
	// format version this build does not know (written by a newer tandem).
	ErrUnknownVersion = errors.New("storage: unknown format version")

	// ErrTruncated is returned by DecodeRecord for input shorter than its
	// encoding says.
	ErrTruncated = errors.New("storage: truncated record")
)
