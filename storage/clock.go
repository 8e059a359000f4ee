package storage

import (
	"encoding/binary"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/tandem-edge/tandem/internal/clock"
)

// The data dir keeps the gateway's clock (internal/clock) across
// restarts: each checkpoint writes the offset in force and the clock's time
// of day, and Open hands both back to Options.Clock. So a jump absorbed
// before a restart stays absorbed after it (records stamped before a
// +5 years jump do not all look 5 years old to the next process), and a
// host that boots with its clock behind the data dir's last checkpoint (a
// board without a real-time clock, in 1970) stamps and measures from there
// on, never before its own records.

// keyClock is the meta key of the clock: offset (int64 ns) | time of day
// (Unix ns) at the checkpoint.
var keyClock = []byte("clock")

// restoreClock hands the kept clock to opts.Clock, once, at Open.
func (db *DB) restoreClock(c *clock.Clock) error {
	if c == nil {
		return nil
	}
	var offset, at int64
	err := db.bolt.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketMeta).Get(keyClock); len(v) == 16 {
			offset = int64(binary.BigEndian.Uint64(v))
			at = int64(binary.BigEndian.Uint64(v[8:]))
		}
		return nil
	})
	if err != nil {
		return err
	}
	var floor time.Time
	if at != 0 {
		floor = time.Unix(0, at)
	}
	if t := db.oldest.Load(); t != 0 && t > at {
		floor = time.Unix(0, t)
	}
	got := c.Restore(time.Duration(offset), floor)
	if got != time.Duration(offset) {
		db.log.Warn("the wall clock is behind this data dir's last checkpoint: the gateway's clock starts from there (a board without a real-time clock?)",
			"behind", (got - time.Duration(offset)).Round(time.Second), "checkpoint_time", floor.UTC().Format(time.RFC3339))
	} else if offset != 0 {
		db.log.Info("the gateway's clock keeps the offset of the wall-clock jumps it absorbed", "offset", time.Duration(offset).Round(time.Second))
	}
	db.clock = c
	return nil
}

// putClock writes the clock into a checkpoint's transaction.
func (db *DB) putClock(m *bolt.Bucket) error {
	if db.clock == nil {
		return nil
	}
	v := make([]byte, 16)
	binary.BigEndian.PutUint64(v, uint64(db.clock.Offset()))
	binary.BigEndian.PutUint64(v[8:], uint64(db.clock.Now().UnixNano()))
	return m.Put(keyClock, v)
}
