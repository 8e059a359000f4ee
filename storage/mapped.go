package storage

import bolt "go.etcd.io/bbolt"

// releaseEvery is how many durable writes (WAL appends and checkpoints)
// pass between two releaseMapped calls. A bbolt commit maps about four
// pages (the new copies of the pages on the log's right edge) and reads
// from the file map more, so at most a few MiB of the file is mapped
// between two.
const releaseEvery = 256

// releaseBytes is how many bytes of entries checkpointed pass between two
// releaseMapped calls however few the commits: a flood of large publishes
// makes few, large checkpoints that map the data file as fast as they
// fill it (a lone gateway under two clients sending 256 KiB publishes had
// 87 MiB of its 76 MiB file mapped).
const releaseBytes = 2 << 20

// committed counts a durable write of n bytes of entries, and releases the
// mappings every releaseEvery writes or releaseBytes bytes.
func (db *DB) committed(n int) {
	if db.commits.Add(1)%releaseEvery == 0 || db.sinceRelease.Add(int64(n)) >= releaseBytes {
		db.sinceRelease.Store(0)
		db.releaseMapped()
	}
}

// releaseMapped drops the process's mappings of the data file's pages.
//
// bbolt reads the file through a shared mmap, and every commit moves the
// log's right edge (copy on write) to pages the next commit reads through
// that mapping. The pages the process has mapped only grow: after a few
// hundred thousand records, tens of megabytes of clean page cache count in
// the gateway's RSS (48 MB of a 67 MB file after 300,000 records), as if
// the daemon held them. Dropping the mappings leaves the pages in the page
// cache, where the kernel accounts and reclaims them as any file's, and
// costs a few minor faults on the pages the next commits touch again.
//
// A read transaction holds bbolt's mmap lock, so the mapping cannot be
// replaced meanwhile. Readers of the mapping are unaffected: MADV_DONTNEED
// on a shared file mapping keeps the file's contents.
func (db *DB) releaseMapped() {
	_ = db.bolt.View(func(tx *bolt.Tx) error {
		unmapPages(db.bolt.Info().Data, uintptr(tx.Size()))
		return nil
	})
}
