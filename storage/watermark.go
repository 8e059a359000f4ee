package storage

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"time"
)

// The free-space watermark (storage.min_free).
//
// The budget (MaxBytes) bounds what the log may take; the watermark guards
// what the filesystem has left for everybody, tandem's next checkpoint
// included: an SD card shared with the OS and other services fills up for
// reasons of its own. Below MinFree the DB reports LowOnSpace, replication
// refuses publishes with a quota error (MQTT 5 0x97), subscribers keep
// being served, and once space returns the refusing ends by itself. The
// checkpointer looks every watermarkEvery and after each checkpoint: a
// statfs per publish would cost the ack path a syscall.

// watermarkEvery is how often the checkpointer reads the free space.
const watermarkEvery = time.Second

// defaultMinFreeShare and defaultMinFreeCap make MinFree's default: 5 % of
// the filesystem or 256 MiB, whichever is smaller.
const (
	defaultMinFreeShare = 20
	defaultMinFreeCap   = 256 << 20
)

// watermark is the DB's view of the free space on its filesystem. Its
// fields are atomics: the checkpointer writes them, proposals read low.
type watermark struct {
	dir     string
	min     atomic.Int64 // bytes to keep free; resolved from MinFree at the first reading
	minOpt  int64        // Options.MinFree
	free    atomic.Int64 // bytes free at the last reading; -1 before one
	low     atomic.Bool
	statfs  func(dir string) (free, total int64, err error) // per DB: tests fake a full disk
	log     *slog.Logger
	failing bool // the last reading failed (checkpointer only)
}

// init sets the watermark up at Open.
func (w *watermark) init(path string, minFree int64, lg *slog.Logger) {
	w.dir, w.minOpt, w.log = filepath.Dir(path), minFree, lg
	w.free.Store(-1)
	if w.statfs == nil {
		w.statfs = statfs
	}
}

// on says whether the watermark is configured.
func (w *watermark) on() bool { return w.minOpt >= 0 && w.statfs != nil }

// check reads the free space and moves low across MinFree, logging each
// crossing once.
func (w *watermark) check() {
	if !w.on() {
		return
	}
	free, total, err := w.statfs(w.dir)
	if err != nil {
		if !w.failing {
			w.log.Warn("cannot read the free space of the data dir's filesystem", "dir", w.dir, "error", err)
		}
		w.failing = true
		return
	}
	w.failing = false
	min := w.minOpt
	if min == 0 {
		min = minFreeDefault(total)
	}
	w.min.Store(min)
	w.free.Store(free)
	low := free < min
	if w.low.Swap(low) == low {
		return
	}
	if low {
		w.log.Warn("free space on the data dir's filesystem is below storage.min_free: refusing publishes (MQTT 5 0x97) until space returns; subscribers are still served",
			"dir", w.dir, "free_bytes", free, "min_free_bytes", min)
	} else {
		w.log.Info("free space on the data dir's filesystem is above storage.min_free again: taking publishes",
			"dir", w.dir, "free_bytes", free, "min_free_bytes", min)
	}
}

// minFreeDefault is MinFree's default for a filesystem of total bytes.
func minFreeDefault(total int64) int64 { return min(total/defaultMinFreeShare, defaultMinFreeCap) }

// LowOnSpace reports whether the data dir's filesystem had less than
// storage.min_free free at the last reading: publishes are refused.
func (db *DB) LowOnSpace() bool { return db.space.low.Load() }

// SpaceStats is the watermark's last reading.
type SpaceStats struct {
	// FreeBytes is the free space on the data dir's filesystem, -1 before
	// the first reading or when the watermark is off.
	FreeBytes int64
	// MinFreeBytes is storage.min_free, resolved (0 when off).
	MinFreeBytes int64
	// Low: see LowOnSpace.
	Low bool
}

// SpaceStats returns the free-space watermark's last reading.
func (db *DB) SpaceStats() SpaceStats {
	return SpaceStats{FreeBytes: db.space.free.Load(), MinFreeBytes: db.space.min.Load(), Low: db.space.low.Load()}
}

// RefusingReason says why the DB refuses new records, for logs, status and
// the devices' reason string; "" when it takes them.
func (db *DB) RefusingReason() string {
	switch {
	case db.space.low.Load():
		return fmt.Sprintf("disk: %d MiB free on the data dir's filesystem, below storage.min_free (%d MiB)",
			db.space.free.Load()>>20, db.space.min.Load()>>20)
	case db.refusing.Load() && db.blockedByHold.Load():
		return "log over budget (storage.max_bytes), and an uplink has not delivered its oldest records to its cloud"
	case db.refusing.Load():
		return "log over budget (storage.max_bytes), and a member still lacks its oldest records"
	}
	return ""
}
