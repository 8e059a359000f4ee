package storage

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
)

// Snapshots of the broker state.
//
// A raft snapshot here is what a member needs to start from a point of the
// log instead of its beginning: the buckets that applying the log builds
// (the members' details, the broker's sessions and retained messages, the
// uplink positions; SnapshotBucket registers them), all read in one bbolt
// read transaction at the applied index that transaction holds, so they are
// a consistent cut. It holds no messages: those are the log's.
//
// Raft asks for it (Snapshot) on its own goroutine when a member's next
// index is below the first index. Reading the buckets can take a while, so
// the first ask starts a build in the background and answers
// raft.ErrSnapshotTemporarilyUnavailable; raft asks again at the next
// heartbeat and gets the built one, as long as the log still holds the
// entries after it (its index is at least the compaction point) and the
// membership did not change since.
//
// Encoding (version 1): "TSNP", version byte, applied index (8), then per
// bucket: 1, name (uvarint length + bytes), then per key 2, key, value
// (uvarint length + bytes each), and 0 at the end; a CRC-32C of all of it
// closes it. The whole snapshot travels in one raft message, so it is
// bounded by MaxSnapshotBytes: a broker state larger than that cannot be
// sent (logged), and the member it was for waits.

// MaxSnapshotBytes bounds an encoded snapshot: it must fit in one frame of
// the peer transport (16 MiB) with room to spare.
const MaxSnapshotBytes = 15 << 20

// snapshotVersion is the encoding this build writes and reads.
const snapshotVersion = 1

// snapshotMagic starts every encoded snapshot.
const snapshotMagic = "TSNP"

// snapshotMaxAge is how old a built snapshot may be before a request
// starts a fresher one (the old one is still handed out meanwhile): a
// member installing it then has fewer entries to fetch.
const snapshotMaxAge = time.Minute

// ErrSnapshotTooLarge reports a broker state whose snapshot would pass
// MaxSnapshotBytes.
var ErrSnapshotTooLarge = errors.New("storage: broker state too large for a snapshot")

// SnapshotConverter writes one bucket's part of a snapshot: it reads the
// bucket through scan (keys with the prefix, in order; k and v are only
// valid during fn) and calls emit for each key and value the snapshot is
// to carry. It runs inside the snapshot's read transaction.
type SnapshotConverter func(scan func(prefix string, fn func(k, v []byte) error) error, emit func(k, v []byte) error) error

// snapBucket is a bucket snapshots carry, with how.
type snapBucket struct {
	name string
	conv SnapshotConverter // nil: every key as it is
}

// snapState is the built snapshot and the build in progress, guarded by
// snapMu.
type snapState struct {
	buckets  []snapBucket
	built    *pb.Snapshot
	builtAt  time.Time
	building bool
	closed   bool  // Close began: no more builds
	failed   error // the last build's error, logged once
}

// SnapshotBucket adds bucket to what snapshots carry (members and
// sessions are always carried), converted by conv (nil: copied as it is).
// Call it before the node starts.
func (db *DB) SnapshotBucket(bucket string, conv SnapshotConverter) {
	db.snapMu.Lock()
	defer db.snapMu.Unlock()
	for i, b := range db.snaps.buckets {
		if b.name == bucket {
			db.snaps.buckets[i].conv = conv
			return
		}
	}
	db.snaps.buckets = append(db.snaps.buckets, snapBucket{name: bucket, conv: conv})
}

// Snapshot implements raft.Storage: the broker state at an applied index
// the log still follows, or raft.ErrSnapshotTemporarilyUnavailable while
// one is being built (raft asks again).
func (db *DB) Snapshot() (pb.Snapshot, error) {
	db.mu.RLock()
	snapIndex, cs := db.snapIndex, db.cs
	db.mu.RUnlock()
	db.snapMu.Lock()
	defer db.snapMu.Unlock()
	b := db.snaps.built
	fresh := b != nil && b.Metadata.Index > 0 && b.Metadata.Index >= snapIndex && sameConf(b.Metadata.ConfState, cs)
	if !db.snaps.closed && !db.ro && !db.snaps.building && (!fresh || time.Since(db.snaps.builtAt) > snapshotMaxAge) {
		db.snaps.building = true
		db.bgWG.Add(1)
		go db.buildSnapshot()
	}
	if !fresh {
		return pb.Snapshot{}, raft.ErrSnapshotTemporarilyUnavailable
	}
	return *b, nil
}

// sameConf reports whether two conf states have the same members.
func sameConf(a, b pb.ConfState) bool {
	return slices.Equal(a.Voters, b.Voters) && slices.Equal(a.Learners, b.Learners) &&
		slices.Equal(a.VotersOutgoing, b.VotersOutgoing) && slices.Equal(a.LearnersNext, b.LearnersNext) &&
		a.AutoLeave == b.AutoLeave
}

// buildSnapshot builds a snapshot in the background and keeps it for the
// next Snapshot call.
func (db *DB) buildSnapshot() {
	defer db.bgWG.Done()
	// The snapshot reads the file: first checkpoint what only the WAL
	// and the stage hold (the membership raft just changed, the applied
	// index), so it is as recent as it can be. A background checkpoint:
	// Save waits for its cut only, not for its commit.
	db.retainDue.Store(true)
	err := db.checkpoint()
	var snap pb.Snapshot
	if err == nil {
		snap, err = db.BuildSnapshot()
	}
	db.snapMu.Lock()
	defer db.snapMu.Unlock()
	db.snaps.building = false
	if err != nil {
		if db.snaps.failed == nil || db.snaps.failed.Error() != err.Error() {
			db.log.Error("building a snapshot of the broker state failed: a member behind the first index cannot be brought up to date", "error", err)
		}
		db.snaps.failed = err
		return
	}
	db.snaps.failed = nil
	db.snaps.built, db.snaps.builtAt = &snap, time.Now()
	db.log.Info("snapshot of the broker state built", "index", snap.Metadata.Index, "bytes", len(snap.Data))
	// Nobody may ask again: do not keep up to MaxSnapshotBytes for ever.
	db.bgWG.Add(1)
	go db.forgetSnapshot(db.snaps.built)
}

// forgetSnapshot drops the built snapshot b once it is too old to be
// handed out without a fresher build starting anyway.
func (db *DB) forgetSnapshot(b *pb.Snapshot) {
	defer db.bgWG.Done()
	t := time.NewTimer(2 * snapshotMaxAge)
	defer t.Stop()
	select {
	case <-t.C:
	case <-db.snapStop:
		return
	}
	db.snapMu.Lock()
	if db.snaps.built == b {
		db.snaps.built = nil
	}
	db.snapMu.Unlock()
}

// BuildSnapshot reads the broker state in one read transaction, at the
// applied index that transaction holds, and encodes it.
func (db *DB) BuildSnapshot() (pb.Snapshot, error) {
	db.snapMu.Lock()
	buckets := slices.Clone(db.snaps.buckets)
	db.snapMu.Unlock()
	for _, name := range []string{BucketSessions, BucketMembers} {
		if !slices.ContainsFunc(buckets, func(b snapBucket) bool { return b.name == name }) {
			buckets = slices.Insert(buckets, 0, snapBucket{name: name})
		}
	}
	var snap pb.Snapshot
	err := db.bolt.View(func(tx *bolt.Tx) error {
		md, err := db.snapshotMeta(tx)
		if err != nil {
			return err
		}
		w := &snapWriter{}
		w.buf.WriteString(snapshotMagic)
		w.buf.WriteByte(snapshotVersion)
		w.buf.Write(u64(md.Index))
		for _, sb := range buckets {
			if err := w.bucket(tx, sb); err != nil {
				return fmt.Errorf("bucket %s: %w", sb.name, err)
			}
		}
		w.buf.WriteByte(0)
		w.buf.Write(binary.BigEndian.AppendUint32(nil, crc32.Checksum(w.buf.Bytes(), castagnoli)))
		if w.buf.Len() > MaxSnapshotBytes {
			return fmt.Errorf("%d bytes, limit %d: %w", w.buf.Len(), MaxSnapshotBytes, ErrSnapshotTooLarge)
		}
		snap = pb.Snapshot{Metadata: md, Data: w.buf.Bytes()}
		return nil
	})
	if err != nil {
		return pb.Snapshot{}, fmt.Errorf("storage: snapshot: %w", err)
	}
	return snap, nil
}

// snapshotMeta is the index, term and membership a snapshot read in tx is
// at: the applied index tx holds, which the log still has (retention never
// drops past the applied index), and the membership tx holds.
func (db *DB) snapshotMeta(tx *bolt.Tx) (pb.SnapshotMetadata, error) {
	var md pb.SnapshotMetadata
	md.Index = metaU64(tx, bucketMeta, keyApplied)
	rs := tx.Bucket(bucketRaftState)
	if v := rs.Get(keyConfState); v != nil {
		if err := md.ConfState.Unmarshal(v); err != nil {
			return md, fmt.Errorf("conf state: %v: %w", err, ErrCorrupt)
		}
	}
	var compacted, compactedTerm uint64
	if v := rs.Get(keySnapMeta); len(v) == 16 {
		compacted, compactedTerm = binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:])
	}
	switch {
	case md.Index < compacted:
		return md, fmt.Errorf("applied index %d below the compaction point %d: %w", md.Index, compacted, ErrCorrupt)
	case md.Index == compacted:
		md.Term = compactedTerm
	default:
		lc := newLogCursor(tx.Bucket(bucketLog))
		if err := lc.seek(md.Index); err != nil {
			return md, err
		}
		idx, v, err := lc.entry()
		if err != nil {
			return md, err
		}
		if v == nil || idx != md.Index {
			return md, fmt.Errorf("applied entry %d missing: %w", md.Index, ErrCorrupt)
		}
		if md.Term, err = checkEntry(idx, v); err != nil {
			return md, err
		}
	}
	return md, nil
}

// snapWriter encodes a snapshot.
type snapWriter struct{ buf bytes.Buffer }

func (w *snapWriter) bytes(b []byte) {
	w.buf.Write(binary.AppendUvarint(nil, uint64(len(b))))
	w.buf.Write(b)
}

// bucket writes sb's section: what its converter emits, or every key.
func (w *snapWriter) bucket(tx *bolt.Tx, sb snapBucket) error {
	w.buf.WriteByte(1)
	w.bytes([]byte(sb.name))
	b := tx.Bucket([]byte(sb.name))
	scan := func(prefix string, fn func(k, v []byte) error) error {
		if b == nil {
			return nil
		}
		c := b.Cursor()
		p := []byte(prefix)
		for k, v := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, v = c.Next() {
			if err := fn(k, v); err != nil {
				return err
			}
		}
		return nil
	}
	emit := func(k, v []byte) error {
		if w.buf.Len() > MaxSnapshotBytes {
			return fmt.Errorf("past %d bytes: %w", MaxSnapshotBytes, ErrSnapshotTooLarge)
		}
		w.buf.WriteByte(2)
		w.bytes(k)
		w.bytes(v)
		return nil
	}
	if sb.conv != nil {
		return sb.conv(scan, emit)
	}
	return scan("", emit)
}

// snapBucketData is one bucket of a decoded snapshot.
type snapBucketData struct {
	name       string
	keys, vals [][]byte
}

// decodeSnapshot checks and decodes a snapshot's data: its applied index
// and its buckets. The values point into data.
func decodeSnapshot(data []byte) (uint64, []snapBucketData, error) {
	bad := func(what string) (uint64, []snapBucketData, error) {
		return 0, nil, fmt.Errorf("snapshot: %s: %w", what, ErrCorrupt)
	}
	if len(data) < len(snapshotMagic)+1+8+1+4 || string(data[:4]) != snapshotMagic {
		return bad("not a tandem snapshot")
	}
	if v := data[4]; v != snapshotVersion {
		return 0, nil, fmt.Errorf("snapshot version %d, this build reads %d: %w", v, snapshotVersion, ErrUnknownVersion)
	}
	body := data[:len(data)-4]
	if got, want := crc32.Checksum(body, castagnoli), binary.BigEndian.Uint32(data[len(data)-4:]); got != want {
		return bad(fmt.Sprintf("CRC mismatch (stored %08x, computed %08x)", want, got))
	}
	applied := binary.BigEndian.Uint64(body[5:])
	rest := body[13:]
	next := func() ([]byte, bool) {
		n, k := binary.Uvarint(rest)
		if k <= 0 || uint64(len(rest)-k) < n {
			return nil, false
		}
		b := rest[k : k+int(n)]
		rest = rest[k+int(n):]
		return b, true
	}
	var out []snapBucketData
	for {
		if len(rest) == 0 {
			return bad("truncated")
		}
		tag := rest[0]
		rest = rest[1:]
		switch tag {
		case 0:
			if len(rest) != 0 {
				return bad("data after the end")
			}
			return applied, out, nil
		case 1:
			name, ok := next()
			if !ok || len(name) == 0 {
				return bad("bucket name")
			}
			out = append(out, snapBucketData{name: string(name)})
		case 2:
			k, ok1 := next()
			v, ok2 := next()
			if !ok1 || !ok2 || len(out) == 0 || len(k) == 0 {
				return bad("key outside a bucket or truncated")
			}
			b := &out[len(out)-1]
			b.keys, b.vals = append(b.keys, k), append(b.vals, v)
		default:
			return bad(fmt.Sprintf("unknown tag %d", tag))
		}
	}
}

// restoreBuckets replaces each bucket of the snapshot in tx with its
// contents, and drops the staged writes to them: they were made on the
// state the snapshot replaces.
func (db *DB) restoreBuckets(tx *bolt.Tx, buckets []snapBucketData) error {
	names := map[string]bool{}
	for _, sb := range buckets {
		names[sb.name] = true
		if tx.Bucket([]byte(sb.name)) != nil {
			if err := tx.DeleteBucket([]byte(sb.name)); err != nil {
				return err
			}
		}
		b, err := tx.CreateBucket([]byte(sb.name))
		if err != nil {
			return err
		}
		b.FillPercent = 0.9 // keys arrive in order
		for i, k := range sb.keys {
			if err := b.Put(k, sb.vals[i]); err != nil {
				return fmt.Errorf("%s/%q: %w", sb.name, k, err)
			}
		}
	}
	db.stageMu.Lock()
	for k, op := range db.staged {
		if names[op.bucket] {
			delete(db.staged, k)
		}
	}
	db.fresh = slices.DeleteFunc(db.fresh, func(op stagedOp) bool { return names[op.bucket] })
	db.stageMu.Unlock()
	return nil
}

// forgetBuilt drops the built snapshot: the log it was taken from was
// replaced (a snapshot installed, the raft state reset).
func (db *DB) forgetBuilt() {
	db.snapMu.Lock()
	db.snaps.built = nil
	db.snapMu.Unlock()
}
