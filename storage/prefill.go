package storage

import (
	"os"

	bolt "go.etcd.io/bbolt"
)

// Bounds of the zeroed space kept past bbolt's high-water mark: refilled
// when less than prefillLow is left, up to prefillHigh. Small, because the
// commit after a refill waits for the zeros to reach the disk: 256 KiB is
// some 13 ms on an SD card that writes 20 MB/s.
const (
	prefillLow  = 256 << 10
	prefillHigh = 512 << 10
)

// zeros is the source of prefill's writes.
var zeros = make([]byte, 64<<10)

// prefill keeps the file written with zeros past bbolt's high-water mark.
//
// bbolt grows its file with ftruncate, so the pages a commit appends land in
// a hole, and that commit's fdatasync must also allocate their blocks and
// journal the allocation. On this VM's ext4 that made a commit of two
// fdatasyncs take 0.40–0.53 ms instead of 0.30–0.35 ms over blocks already
// written (FACTS.md has the method). Writing the zeros ahead, 256 KiB at a
// time, pays the allocation once per 256 KiB, and sync_file_range starts
// their write-back at once, so the next commit's fdatasync finds less of it
// left to do. The price is writing the log's new space twice (about 20 %
// more bytes to the device at 100-byte publishes), as PostgreSQL does for
// its WAL segments (wal_init_zero) for the same reason.
//
// It runs inside a write transaction: bbolt writes nowhere past its
// high-water mark until this transaction commits, and that commit writes
// its new pages after the zeros. The space past the mark holds no data
// (bbolt never reads it), so nothing is lost by zeroing it. A failure (a
// full disk) only ends the prefill until the next try; the commit itself
// then fails or not as it would have.
func (db *DB) prefill(tx *bolt.Tx) {
	hw := tx.Size()
	if db.zeroedTo >= hw+prefillLow {
		return
	}
	if db.zeroFile == nil {
		f, err := os.OpenFile(db.path, os.O_WRONLY, 0)
		if err != nil {
			return
		}
		db.zeroFile = f
	}
	from := max(db.zeroedTo, hw)
	to := hw + prefillHigh
	for off := from; off < to; off += int64(len(zeros)) {
		if _, err := db.zeroFile.WriteAt(zeros[:min(int64(len(zeros)), to-off)], off); err != nil {
			return
		}
		db.zeroedTo = off + min(int64(len(zeros)), to-off)
	}
	startWriteback(db.zeroFile, from, to-from)
}
