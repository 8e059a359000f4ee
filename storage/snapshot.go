package storage

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
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
// closes it.
//
// Transfer. The build writes the encoding to a file in the data dir
// (snapshotFile), never whole into memory. One that fits in
// SetSnapshotInline's limit (default InlineSnapshotBytes) travels in the
// raft message itself, as with builds before the limit existed. A larger
// one cannot (a peer frame holds 16 MiB) and need not: raft's message then
// carries a SnapshotRef ("TSNR", version, index, size, CRC), and the member
// pulls the body in chunks (ReadSnapshot on the master's side, SnapshotIn
// on its own, which decodes the received part into the data file as it
// comes: snapin.go) before raft sees the snapshot. A new build replaces
// the file; a pull of the old one is then answered ErrSnapshotGone, and
// raft sends the new one.

// InlineSnapshotBytes is the default of SetSnapshotInline: snapshots up to
// this size travel inside raft's message, larger ones by reference.
const InlineSnapshotBytes = 4 << 20

// snapshotVersion is the encoding this build writes and reads.
const snapshotVersion = 1

// snapshotMagic starts every encoded snapshot; snapshotRefMagic a
// SnapshotRef.
const (
	snapshotMagic    = "TSNP"
	snapshotRefMagic = "TSNR"
	snapshotRefLen   = 4 + 1 + 8 + 8 + 4
)

// Files in the data dir: the master's built snapshot, which can be rebuilt
// (it is not fsynced), and the one a member received into before builds
// staged it in the data file (snapin.go), removed if an upgrade finds it.
const (
	snapshotFile   = "snapshot.tsnp"
	snapshotInFile = "snapshot-in.tsnp"
)

// snapshotMaxAge is how old a built snapshot may be before a request
// starts a fresher one (the old one is still handed out meanwhile): a
// member installing it then has fewer entries to fetch.
const snapshotMaxAge = time.Minute

// ErrSnapshotGone answers a pull of a snapshot this member no longer holds
// (a newer build replaced it, or none was built): the member waits for
// raft to send the current one.
var ErrSnapshotGone = errors.New("storage: that snapshot is no longer held here")

// SnapshotRef names a built snapshot that is pulled, not sent: what raft's
// message carries when the snapshot is larger than the inline limit.
type SnapshotRef struct {
	Index uint64 // its applied index, the same as its metadata's
	Size  uint64 // the encoding's bytes
	CRC   uint32 // the encoding's own closing CRC
}

// encode is the ref as raft's snapshot data.
func (r SnapshotRef) encode() []byte {
	b := append([]byte(snapshotRefMagic), snapshotVersion)
	b = binary.BigEndian.AppendUint64(b, r.Index)
	b = binary.BigEndian.AppendUint64(b, r.Size)
	return binary.BigEndian.AppendUint32(b, r.CRC)
}

// ParseSnapshotRef reads the ref a raft snapshot's data carries; false
// when the data is a snapshot itself (or anything else).
func ParseSnapshotRef(data []byte) (SnapshotRef, bool) {
	if len(data) != snapshotRefLen || string(data[:4]) != snapshotRefMagic || data[4] != snapshotVersion {
		return SnapshotRef{}, false
	}
	return SnapshotRef{Index: binary.BigEndian.Uint64(data[5:]), Size: binary.BigEndian.Uint64(data[13:]), CRC: binary.BigEndian.Uint32(data[21:])}, true
}

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
	// ref names the body in snapshotFile when built is sent by reference.
	ref SnapshotRef
	// inline is the largest snapshot sent inside raft's message (0: the
	// default).
	inline int64
}

// SetSnapshotInline sets the largest snapshot that travels inside raft's
// message (n <= 0: InlineSnapshotBytes); larger ones are pulled by
// reference. Tests set it low to exercise the pull.
func (db *DB) SetSnapshotInline(n int64) {
	db.snapMu.Lock()
	db.snaps.inline = n
	db.snapMu.Unlock()
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
	var (
		snap pb.Snapshot
		ref  SnapshotRef
		tmp  string
	)
	if err == nil {
		snap, ref, tmp, err = db.buildSnapshotFile()
	}
	db.snapMu.Lock()
	defer db.snapMu.Unlock()
	db.snaps.building = false
	if err == nil {
		err = db.swapSnapshotFileLocked(tmp)
	}
	if err != nil {
		if db.snaps.failed == nil || db.snaps.failed.Error() != err.Error() {
			db.log.Error("building a snapshot of the broker state failed: a member behind the first index cannot be brought up to date", "error", err)
		}
		db.snaps.failed = err
		return
	}
	db.snaps.failed = nil
	db.snaps.built, db.snaps.builtAt, db.snaps.ref = &snap, time.Now(), ref
	db.log.Info("snapshot of the broker state built", "index", snap.Metadata.Index, "bytes", ref.Size, "by_reference", len(snap.Data) < int(ref.Size))
	// Nobody may ask again: do not keep it for ever.
	db.bgWG.Add(1)
	go db.forgetSnapshot(db.snaps.built)
}

// buildSnapshotFile encodes the broker state into a temporary file. A
// body within the inline limit is read back into the snapshot's data and
// the file removed; a larger one stays there (tmp names it), and the
// snapshot's data is its ref. Called by buildSnapshot only (one build at a
// time).
func (db *DB) buildSnapshotFile() (snap pb.Snapshot, ref SnapshotRef, tmp string, err error) {
	db.snapMu.Lock()
	inline := db.snaps.inline
	db.snapMu.Unlock()
	if inline <= 0 {
		inline = InlineSnapshotBytes
	}
	tmp = filepath.Join(filepath.Dir(db.path), snapshotFile+".tmp")
	f, err := os.Create(tmp)
	if err != nil {
		return snap, ref, "", fmt.Errorf("storage: snapshot: %w", err)
	}
	md, ref, err := db.encodeSnapshot(countWriter{f, &db.snapWritten})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	snap.Metadata = md
	switch {
	case err != nil:
	case int64(ref.Size) <= inline:
		snap.Data, err = os.ReadFile(tmp)
	default:
		snap.Data = ref.encode()
		return snap, ref, tmp, nil
	}
	os.Remove(tmp)
	if err != nil {
		return snap, ref, "", fmt.Errorf("storage: snapshot: %w", err)
	}
	return snap, ref, "", nil
}

// swapSnapshotFileLocked puts the body a build left in tmp ("" for none:
// the snapshot is inline) in place of the previous one, under snapMu, at
// the same time as the build replaces the previous snapshot: a pull then
// reads a body and a ref of the same build.
func (db *DB) swapSnapshotFileLocked(tmp string) error {
	path := filepath.Join(filepath.Dir(db.path), snapshotFile)
	if tmp == "" {
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("storage: snapshot: %w", err)
		}
		return nil
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("storage: snapshot: %w", err)
	}
	return nil
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
		db.snaps.built, db.snaps.ref = nil, SnapshotRef{}
		os.Remove(filepath.Join(filepath.Dir(db.path), snapshotFile))
	}
	db.snapMu.Unlock()
}

// ReadSnapshot is the master's side of a pull: up to max bytes of the body
// ref names, from off. ErrSnapshotGone when ref is not the snapshot held
// now.
func (db *DB) ReadSnapshot(ref SnapshotRef, off uint64, max int) ([]byte, error) {
	db.snapMu.Lock()
	held := db.snaps.built != nil && db.snaps.ref == ref && len(db.snaps.built.Data) < int(ref.Size)
	var f *os.File
	var err error
	if held {
		f, err = os.Open(filepath.Join(filepath.Dir(db.path), snapshotFile))
	}
	db.snapMu.Unlock()
	switch {
	case !held || errors.Is(err, os.ErrNotExist):
		return nil, ErrSnapshotGone
	case err != nil:
		return nil, fmt.Errorf("storage: snapshot: %w", err)
	case off > ref.Size:
		f.Close()
		return nil, fmt.Errorf("storage: snapshot: offset %d past its %d bytes", off, ref.Size)
	}
	defer f.Close()
	buf := make([]byte, min(uint64(max), ref.Size-off))
	if _, err := f.ReadAt(buf, int64(off)); err != nil {
		return nil, fmt.Errorf("storage: snapshot: %w", err)
	}
	return buf, nil
}

// BuildSnapshot reads the broker state in one read transaction, at the
// applied index that transaction holds, and encodes it in memory (the
// background build, buildSnapshot, writes a file instead).
func (db *DB) BuildSnapshot() (pb.Snapshot, error) {
	var buf bytes.Buffer
	md, _, err := db.encodeSnapshot(&buf)
	if err != nil {
		return pb.Snapshot{}, fmt.Errorf("storage: snapshot: %w", err)
	}
	return pb.Snapshot{Metadata: md, Data: buf.Bytes()}, nil
}

// encodeSnapshot writes the broker state, read in one read transaction at
// the applied index it holds, to out.
func (db *DB) encodeSnapshot(out io.Writer) (pb.SnapshotMetadata, SnapshotRef, error) {
	db.snapMu.Lock()
	buckets := slices.Clone(db.snaps.buckets)
	db.snapMu.Unlock()
	for _, name := range []string{BucketSessions, BucketMembers} {
		if !slices.ContainsFunc(buckets, func(b snapBucket) bool { return b.name == name }) {
			buckets = slices.Insert(buckets, 0, snapBucket{name: name})
		}
	}
	var (
		md  pb.SnapshotMetadata
		ref SnapshotRef
	)
	err := db.bolt.View(func(tx *bolt.Tx) error {
		var err error
		if md, err = db.snapshotMeta(tx); err != nil {
			return err
		}
		w := &snapWriter{w: bufio.NewWriterSize(out, 64<<10), crc: crc32.New(castagnoli)}
		w.write([]byte(snapshotMagic))
		w.write([]byte{snapshotVersion})
		w.write(u64(md.Index))
		for _, sb := range buckets {
			if err := w.bucket(tx, sb); err != nil {
				return fmt.Errorf("bucket %s: %w", sb.name, err)
			}
		}
		w.write([]byte{0})
		ref = SnapshotRef{Index: md.Index, CRC: w.crc.Sum32()}
		w.write(binary.BigEndian.AppendUint32(nil, ref.CRC))
		ref.Size = w.n
		if w.err == nil {
			w.err = w.w.Flush()
		}
		return w.err
	})
	return md, ref, err
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
	case db.chain: // past the compaction point: in the segments
		t, err := db.Term(md.Index)
		if err != nil {
			return md, err
		}
		md.Term = t
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

// countWriter is w adding the bytes it took to n: what a file of the
// data dir outside the log costs the device (DB.Written).
type countWriter struct {
	w io.Writer
	n *atomic.Int64
}

func (c countWriter) Write(p []byte) (int, error) {
	k, err := c.w.Write(p)
	c.n.Add(int64(k))
	return k, err
}

// snapWriter encodes a snapshot into w, summing its CRC; the first write
// error sticks.
type snapWriter struct {
	w   *bufio.Writer
	crc hash.Hash32
	n   uint64
	err error
	tmp [binary.MaxVarintLen64]byte
}

func (w *snapWriter) write(p []byte) {
	if w.err != nil {
		return
	}
	w.crc.Write(p)
	_, w.err = w.w.Write(p)
	w.n += uint64(len(p))
}

func (w *snapWriter) bytes(b []byte) {
	w.write(binary.AppendUvarint(w.tmp[:0], uint64(len(b))))
	w.write(b)
}

// bucket writes sb's section: what its converter emits, or every key.
func (w *snapWriter) bucket(tx *bolt.Tx, sb snapBucket) error {
	w.write([]byte{1})
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
		w.write([]byte{2})
		w.bytes(k)
		w.bytes(v)
		return w.err
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

// forgetBuilt drops the built snapshot: the log it was taken from was
// replaced (a snapshot installed, the raft state reset).
func (db *DB) forgetBuilt() {
	db.snapMu.Lock()
	db.snaps.built = nil
	db.snapMu.Unlock()
}

// DropSnapshotFiles removes what snapshots an earlier run left in the
// data dir: a body built for raft (it is rebuilt when asked for), and one
// being received (a new pull starts over): the staging bucket, and the
// file builds before it received into. Call it before the node starts.
func (db *DB) DropSnapshotFiles() {
	if db.ro {
		return
	}
	if err := db.dropStaging(); err != nil {
		db.log.Warn("dropping a snapshot an earlier run received in part failed: the next one received drops it", "error", err)
	}
	db.snapMu.Lock()
	defer db.snapMu.Unlock()
	dir := filepath.Dir(db.path)
	if db.snaps.built == nil && !db.snaps.building {
		os.Remove(filepath.Join(dir, snapshotFile))
		os.Remove(filepath.Join(dir, snapshotFile+".tmp"))
	}
	os.Remove(filepath.Join(dir, snapshotInFile))
}
