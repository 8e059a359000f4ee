// Package storage owns the node's data file: one bbolt file holding the raft
// log (runs of entries by first index, logrun.go), the raft hard state and conf state, and small
// metadata buckets (format version, node id, applied index, requeued entries,
// the broker's persistent sessions and retained messages), with a
// write-ahead log in front of it (wal.go, checkpoint.go).
//
// DB implements raft.Storage over that file; no MemoryStorage holds the log.
// Save appends a whole Ready batch to the WAL in one frame, so many
// publishes share one fdatasync; a background checkpoint writes the WAL's
// entries into bbolt in one transaction, 256 KiB of them at a time, as runs; until
// then the tail cache serves them. Metadata written through Stage rides
// along with the next frame, so it costs no fsync of its own and is never
// newer on disk than the entries proposed after it.
//
// Retention (retention.go) keeps the data dir within Options.MaxBytes plus
// RetentionSlack and drops records past Options.MaxAge: whole runs from the
// front of the log, inside a checkpoint's transaction, never past the floor
// replication sets (what every member holds) or the applied index. The drop
// point is raft's compaction point: FirstIndex moves past it and Entries and
// Term answer ErrCompacted below it. A member behind it gets raft's
// snapshot (snapshot.go): the broker-state buckets at an applied index,
// read in one transaction, versioned and CRC-checked; ApplySnapshot
// replaces them and the log in one transaction; the records before it that
// the master still holds are pulled afterwards into the backfill bucket
// (backfill.go), which Scan reads as the log's past.
//
// Durability: every entry carries a CRC-32C, checked on every read and for
// the whole log at Open; every WAL frame carries one too. A file that is
// empty, truncated, locked by another process or fails a check, or a WAL
// frame damaged with good ones after it, is reported with ErrCorrupt or
// ErrInUse and left exactly as it is; nothing here ever resets a file. bbolt
// itself falls back to the last complete commit after a torn one, and the
// WAL ends at its first frame torn by a crash (never acked, since its
// fdatasync had not returned).
//
// Threading: the raft.Storage methods may be called from any goroutine; Save
// is called only by the replication loop, which keeps the log's order.
//
// The record encoding (DecodeRecord, AppendRecord) also lives here: it is
// the unit the log stores and the CRC the daemon checks on read.
package storage
