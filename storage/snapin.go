package storage

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"maps"
	"math"
	"slices"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// Receiving a snapshot within the budget (issue #32).
//
// A member installing a snapshot used to hold, all at once: its own log
// and broker state, the body as received (snapshot-in.tsnp), and the
// buckets the install wrote from it, in the one transaction that also
// deleted the log, whose pages bbolt cannot reuse before that transaction
// commits. A 7 MB broker state on a 16MiB budget took the data dir to
// 24 MB. Now:
//
//   - ReceiveSnapshot first drops, in a commit of its own, the log up to
//     the applied index and the records pulled from before an earlier
//     snapshot: the snapshot supersedes them (it is past the master's first
//     index, so no member needs them from this one, and the broker state
//     it brings includes them). The pages they free take what follows.
//   - The body is decoded as it arrives, one commit per chunk, into the
//     snapshot_in bucket, against this member's own state: a key whose
//     value this member holds already is noted only (snapshot_in/same/B),
//     the others are written as they will stay (snapshot_in/vals/B). A
//     member that was away for a while holds most of the state already: it
//     stages little.
//   - Finish decides, per bucket: where most of it is new (a joiner: all
//     of it), the values noted "same" are copied into vals/B, and the
//     install moves vals/B in place of B (bbolt's MoveBucket: only the
//     bucket's root changes parent, no page is copied). Else the install
//     writes vals/B into B and deletes the keys of B the snapshot lacks.
//
// So the data dir holds, beside the member's own broker state, the part of
// the snapshot's that differs from it, twice at most (staged, then written
// where it stays); at worst, half of the state or more changed, the broker
// state twice. Plus what is left of the log (the entries past the applied
// index) and the WAL. The records the member then pulls from before the
// snapshot (backfill.go) go into the pages the install freed, and
// retention drops them first when the budget is reached.
//
// A key noted "same" must keep the snapshot's value until the install:
// a write to it meanwhile (the broker's, through the stage: commitCut)
// first copies the value it replaces, the snapshot's, into vals/B
// (keepSnapshotValue). A key of B written that the snapshot lacks goes at
// the install, as the snapshot says; one not compared yet is compared as
// it is when its turn comes.
//
// The staging belongs to one receiving at a time (snapIn.gen): a newer
// ReceiveSnapshot, an install, Close or a raft reset ends the one before,
// whose writes then fail with ErrSnapshotGone. All changes to it happen
// inside commits, which ckMu serialises, so a check of gen there holds
// until the commit. Nothing of it survives a restart: DropSnapshotFiles
// deletes it, and the master sends the snapshot again.
//
// Merged in place. Staging a bucket most of which changed would hold it
// twice: the snapshot's beside this member's (a 4,000-message state all
// replaced took a slave on a 16MiB budget to 19.8 MB). So once the bytes
// staged for a bucket pass a quarter of what this member's bucket holds
// (inPlaceShare) or 1/64 of the budget (stageShare), and the bucket
// holds 512 KiB or more (inPlaceMin), the decoding writes that bucket in
// place instead: the
// values staged so far are written into it and the keys before them that
// the snapshot lacks deleted, and from then on each key received is
// written there (when its value differs) and the keys between it and the
// one before deleted; the end of the bucket deletes the keys past its
// last. The data file then holds the bucket once, plus the part staged
// before (a quarter of it, 1/64 of the budget or 512 KiB at most) and the
// pages one commit (writePiece) rewrites, and the pages the merge frees
// take what follows.
//
// The bucket is then neither this member's state nor the snapshot's: the
// commit that begins the merge also sets keyInstalling in the meta
// bucket, and only an install clears it. A crash, a cut pull or a
// damaged body leave it set: the state is known incomplete, never taken
// for whole (InstallInterrupted; Open logs it), and the member applies
// nothing and serves nothing until a snapshot installs: it asks the master
// for one, whatever the master's log holds (replication/incomplete.go).
// A write of the broker to a key the merge has passed first keeps the
// snapshot's value (or its absence) in the staging (snapInPlace), which
// the install writes back: the snapshot wins, as for the staged buckets.
//
// A snapshot received whole and checked (Finish) reaches raft as a staged
// ref ("TSNS", then as SnapshotRef): ApplySnapshot installs what the
// staging holds, which must be that snapshot. A snapshot that travelled
// in raft's message (within the inline limit) is staged the same way by
// ApplySnapshot before it installs it.

// bucketSnapIn holds the snapshot being received: snapInVals and
// snapInSame, each with a nested bucket per bucket the snapshot carries.
var (
	bucketSnapIn = []byte("snapshot_in")
	snapInVals   = []byte("vals") // the values to install
	snapInSame   = []byte("same") // the keys whose value this member holds already
	// snapInPlace has a nested bucket per bucket merged in place (see
	// "Merged in place" above), holding the snapshot's values of its
	// keys that the broker wrote once the merge had passed them: keptValue.
	snapInPlace = []byte("inplace")
)

// keyInstalling, in the meta bucket, is set while a bucket of this
// member's broker state holds part of a snapshot's and part of its own
// (merged in place): the state is incomplete until a snapshot installs.
// Its value is the ref of the snapshot whose merge set it.
var keyInstalling = []byte("installing")

// sameMark is the value of a key in snapInSame.
var sameMark = []byte{1}

// stagedMagic starts a staged ref.
const stagedMagic = "TSNS"

// snapInState is the staging's owner, guarded by snapInMu.
type snapInState struct {
	gen    uint64      // the receiving that owns the staging
	sealed SnapshotRef // the snapshot staged whole and checked; zero if none
	// merged is, per bucket merged in place, how far the merge is in
	// the data file (its last commit): a broker write to a key up to
	// there keeps the snapshot's value first (keepSnapshotValue).
	merged map[string]mergePos
}

// mergePos is how far a bucket merged in place is: its last key written
// from the snapshot, or done when the snapshot's part of it ended.
type mergePos struct {
	last []byte
	done bool
}

// passed reports whether the merge has passed key.
func (p mergePos) passed(key []byte) bool {
	return p.done || (p.last != nil && bytes.Compare(key, p.last) <= 0)
}

// inPlaceShare: a bucket is merged in place once the bytes staged for it
// pass 1/inPlaceShare of what this member's holds.
const inPlaceShare = 4

// stageShare: a bucket is merged in place too once the bytes staged for it
// pass 1/stageShare of the budget (Options.MaxBytes), inPlaceMin at least:
// the switch writes them into the bucket in one commit, beside the pages
// they and the bucket's rewritten ones hold until it ends (a quarter of
// an 11 MB state staged took a 16MiB budget's data dir to 20.6 MB at that
// commit; a sixteenth of the budget, to 19.8 MB once in e2e).
const stageShare = 64

// inPlaceMin is the default of DB.inPlaceMin: a bucket smaller than that
// in this member's data file is staged whole rather than merged in place
// (its second copy fits the slack), so a member whose broker state is
// small (the members' details: replication reads them while it pulls)
// never has it incomplete.
const inPlaceMin = 512 << 10

// encodeStaged is the ref as the data of a snapshot raft installs from the
// staging.
func (r SnapshotRef) encodeStaged() []byte {
	b := r.encode()
	copy(b, stagedMagic)
	return b
}

// ParseStagedSnapshot reads the ref a raft snapshot's data carries when
// the snapshot was received here and waits in the staging (Finish); false
// for anything else.
func ParseStagedSnapshot(data []byte) (SnapshotRef, bool) {
	if len(data) != snapshotRefLen || string(data[:4]) != stagedMagic {
		return SnapshotRef{}, false
	}
	b := bytes.Clone(data)
	copy(b, snapshotRefMagic)
	return ParseSnapshotRef(b)
}

// SnapshotStaged reports whether ref was received here whole and waits in
// the staging for its install.
func (db *DB) SnapshotStaged(ref SnapshotRef) bool {
	db.snapInMu.Lock()
	defer db.snapInMu.Unlock()
	return ref != SnapshotRef{} && db.snapIn.sealed == ref
}

// ownBucket says whether a bucket is this member's own, never carried by
// a snapshot: one that carries it is damaged or hostile.
func ownBucket(name []byte) bool {
	for _, b := range [][]byte{bucketLog, bucketRaftState, bucketMeta, bucketRequeue, bucketBackfill, bucketSnapIn} {
		if bytes.Equal(name, b) {
			return true
		}
	}
	return false
}

// SnapshotIn is a snapshot a member is receiving (SnapshotRef): each chunk
// is decoded into the staging as it comes, so a cut link resumes at
// Offset. One goroutine uses it.
type SnapshotIn struct {
	db   *DB
	gen  uint64
	ref  SnapshotRef
	off  uint64
	crc  hash.Hash32 // of the bytes before the closing CRC, so far
	tail []byte      // the closing CRC's bytes received so far
	dec  snapDecoder
}

// snapDecoder is where the decoding of a body stands between chunks.
type snapDecoder struct {
	header  bool   // the header is read
	index   uint64 // the applied index it gives
	bucket  []byte // the bucket keys go to; nil before the first
	ended   bool   // the end tag was read
	pending []byte // the start of an item the next chunk completes
	// diff counts, per bucket, the bytes of keys and values noted the
	// same as this member's and of those staged: Finish's choice.
	diff map[string]bucketDiff
	// live is the bytes the current bucket held in this member's data
	// when its part began (0: it had none), the measure of inPlaceShare.
	live int64
	// merged is, per bucket merged in place, how far the merge is.
	merged map[string]mergePos
	// minLive is the smallest bucket merged in place (DB.inPlaceMin).
	minLive int64
	// stageMax is the most a bucket's staged part may take before it is
	// merged in place however small a share of the bucket it is: a
	// 1/stageShare of the budget.
	stageMax int64
}

// bucketDiff is how much of a bucket's snapshot this member holds already
// (same) and how much it staged (changed), in bytes of keys and values
// with their headers in a page (leafElem), as bbolt's LeafInuse counts
// them, which the staged bytes are measured against.
type bucketDiff struct{ same, changed int64 }

// ReceiveSnapshot starts receiving the snapshot ref names, ending any
// receiving before it. It first drops what the snapshot supersedes: the
// log up to the applied index (not the entries past it: those past the
// commit index may be this member's own, which the install re-publishes)
// and the records pulled from before an earlier snapshot.
func (db *DB) ReceiveSnapshot(ref SnapshotRef) (*SnapshotIn, error) {
	if db.ro {
		return nil, fmt.Errorf("storage: receiving a snapshot on a read-only file")
	}
	if ref.Size < uint64(len(snapshotMagic)+1+8+1+4) {
		return nil, fmt.Errorf("storage: snapshot of %d bytes: %w", ref.Size, ErrCorrupt)
	}
	in := &SnapshotIn{db: db, ref: ref, crc: crc32.New(castagnoli)}
	in.dec.minLive = db.inPlaceMin
	in.dec.stageMax = math.MaxInt64
	if db.ret.maxBytes > 0 {
		in.dec.stageMax = max(db.ret.maxBytes/stageShare, inPlaceMin)
	}
	var drop dropResult
	err := db.commitSync(0, func(tx *bolt.Tx) error {
		if err := db.dropStagingIn(tx); err != nil {
			return err
		}
		db.snapInMu.Lock()
		in.gen = db.snapIn.gen
		db.snapInMu.Unlock()
		st, err := tx.CreateBucket(bucketSnapIn)
		if err != nil {
			return err
		}
		for _, name := range [][]byte{snapInVals, snapInSame, snapInPlace} {
			if _, err := st.CreateBucket(name); err != nil {
				return err
			}
		}
		if err := startBackfill(tx, 0); err != nil {
			return err
		}
		var hs pb.HardState
		if v := tx.Bucket(bucketRaftState).Get(keyHardState); v != nil {
			if err := hs.Unmarshal(v); err != nil {
				return fmt.Errorf("hard state: %v: %w", err, ErrCorrupt)
			}
		}
		limit := min(metaU64(tx, bucketMeta, keyApplied), hs.Commit)
		if db.chain {
			// The segment frames go to holds entries up to the
			// applied index: a cut first makes it one retention may
			// drop, and the replay point moves past it (no frame came
			// since the checkpoint's mark: wmu is held).
			if err := db.sealLocked(); err != nil {
				return err
			}
			w := db.wal
			if err := tx.Bucket(bucketMeta).Put(keyWAL, walValue(w.id, uint64(w.cur), 0)); err != nil {
				return err
			}
			return db.dropSegments(tx, &drop, 0, math.MaxInt64, math.MinInt64, limit, limit)
		}
		drop, err = db.dropLogTo(tx, limit)
		return err
	}, func() {
		if db.chain {
			db.applySegmentDrop(drop, 0)
		}
		if drop.some {
			db.oldest.Store(0)
			_ = db.loadOldest()
		}
	})
	if err != nil {
		db.undoDrop(drop)
		return nil, fmt.Errorf("storage: receiving a snapshot: %w", err)
	}
	if drop.some {
		db.log.Info("receiving a snapshot: dropped the log it supersedes", "first_index", drop.snapIndex+1, "records", drop.records, "snapshot_index", ref.Index)
	}
	return in, nil
}

// dropLogTo deletes, in tx, the log's runs that end at or below limit and
// makes the last of them the compaction point, as retention does
// (compactTo); undoDrop puts the in-memory bounds back if tx fails.
func (db *DB) dropLogTo(tx *bolt.Tx, limit uint64) (dropResult, error) {
	var res dropResult
	c := tx.Bucket(bucketLog).Cursor()
	var gone [][]byte
	for k, v := c.First(); k != nil; k, v = c.Next() {
		it, err := readHead(c, k, v)
		if err != nil {
			return res, err
		}
		last, term, records, _, err := runInfo(it.first, it.run, it.v)
		if err != nil {
			return res, err
		}
		if last > limit {
			break
		}
		gone = append(gone, it.keys(k)...)
		res.snapIndex, res.snapTerm, res.some = last, term, true
		res.records += records
	}
	if !res.some {
		return res, nil
	}
	return res, db.compactTo(tx, gone, &res)
}

// Ref is the snapshot being received.
func (in *SnapshotIn) Ref() SnapshotRef { return in.ref }

// Offset is how many bytes have been received.
func (in *SnapshotIn) Offset() uint64 { return in.off }

// Done reports whether the whole body is here.
func (in *SnapshotIn) Done() bool { return in.off == in.ref.Size }

// current reports whether in still owns the staging; inside a commit,
// until it ends.
func (in *SnapshotIn) current() bool {
	in.db.snapInMu.Lock()
	defer in.db.snapInMu.Unlock()
	return in.db.snapIn.gen == in.gen
}

// staging returns the staging's buckets in tx, if in still owns them.
func (in *SnapshotIn) staging(tx *bolt.Tx) (vals, same, place *bolt.Bucket, err error) {
	st := tx.Bucket(bucketSnapIn)
	if !in.current() || st == nil {
		return nil, nil, nil, ErrSnapshotGone
	}
	vals, same, place = st.Bucket(snapInVals), st.Bucket(snapInSame), st.Bucket(snapInPlace)
	if vals == nil || same == nil || place == nil {
		return nil, nil, nil, fmt.Errorf("the staging lacks its buckets: %w", ErrCorrupt)
	}
	return vals, same, place, nil
}

// writePiece is the most of the body one commit of Write decodes: a merge
// in place rewrites the pages of what it writes, beside the old ones
// until the commit ends (pieces of a whole 1 MiB chunk took a 16MiB
// budget's data dir 3 MB past its size; of 256 KiB, not past it).
const writePiece = 256 << 10

// Write decodes the next bytes of the body into the staging, in commits
// of writePiece bytes at most: when one fails, what the commits before it
// took is taken (Offset says how far), nothing of its own, and the rest
// can be written again from Offset. ErrSnapshotGone when a newer
// receiving or an install took the staging.
func (in *SnapshotIn) Write(p []byte) error {
	for len(p) > writePiece {
		if err := in.writePiece(p[:writePiece]); err != nil {
			return err
		}
		p = p[writePiece:]
	}
	return in.writePiece(p)
}

// writePiece is Write of at most writePiece bytes, in one commit.
func (in *SnapshotIn) writePiece(p []byte) error {
	if uint64(len(p)) > in.ref.Size-in.off {
		return fmt.Errorf("storage: snapshot chunk passes its %d bytes: %w", in.ref.Size, ErrCorrupt)
	}
	// The last 4 bytes are the closing CRC, not items.
	bodyEnd := in.ref.Size - 4
	nb := 0
	if in.off < bodyEnd {
		nb = int(min(uint64(len(p)), bodyEnd-in.off))
	}
	body, closing := p[:nb], p[nb:]
	dec := in.dec
	dec.diff = maps.Clone(in.dec.diff)
	if dec.diff == nil {
		dec.diff = map[string]bucketDiff{}
	}
	dec.merged = maps.Clone(in.dec.merged)
	if dec.merged == nil {
		dec.merged = map[string]mergePos{}
	}
	if len(body) > 0 {
		// The merge's positions reach the broker's commits once this
		// one committed, before the next (commitSync holds ckMu until
		// after has run): a write to a key this chunk merged keeps the
		// snapshot's value, one to a key it did not is merged over.
		var installing bool
		err := in.db.commitSync(0, func(tx *bolt.Tx) error {
			vals, same, place, err := in.staging(tx)
			if err != nil {
				return err
			}
			if err := dec.feed(tx, vals, same, place, body, in.ref.Size); err != nil {
				return err
			}
			if len(dec.merged) > 0 && tx.Bucket(bucketMeta).Get(keyInstalling) == nil {
				installing = true
				return tx.Bucket(bucketMeta).Put(keyInstalling, in.ref.encode())
			}
			return nil
		}, func() {
			in.db.snapInMu.Lock()
			if in.db.snapIn.gen == in.gen {
				in.db.snapIn.merged = dec.merged
			}
			in.db.snapInMu.Unlock()
			if installing {
				in.db.installing.Store(true)
			}
		})
		if err != nil {
			return fmt.Errorf("storage: receiving a snapshot: %w", err)
		}
		if installing {
			in.db.log.Warn("receiving a snapshot most of whose broker state differs from this member's: merging it in place; until it is installed the broker state is incomplete, and a restart waits for the master to send it again",
				"snapshot_index", in.ref.Index, "bytes", in.ref.Size)
		}
	}
	in.dec = dec
	in.crc.Write(body)
	in.tail = append(in.tail, closing...)
	in.off += uint64(len(p))
	return nil
}

// feed decodes body, the bytes after what d has read, into the staging
// buckets vals and same of tx, or into this member's buckets for those
// merged in place (place holds what the merge keeps of them); an item
// body ends inside waits in pending for the rest. Its keys and values go
// to bbolt as slices of body and pending, which stay untouched until the
// transaction ends. limit bounds a length field.
func (d *snapDecoder) feed(tx *bolt.Tx, vals, same, place *bolt.Bucket, body []byte, limit uint64) error {
	bad := func(what string) error { return fmt.Errorf("snapshot: %s: %w", what, ErrCorrupt) }
	buf := append(d.pending[:len(d.pending):len(d.pending)], body...)
	// field reads one length-prefixed field; ok false when buf ends first.
	field := func(b []byte) (f, rest []byte, ok bool, err error) {
		n, k := binary.Uvarint(b)
		switch {
		case k == 0:
			return nil, nil, false, nil
		case k < 0 || n > limit:
			return nil, nil, false, bad("field length")
		case uint64(len(b)-k) < n:
			return nil, nil, false, nil
		}
		return b[k : k+int(n)], b[k+int(n):], true, nil
	}
	// The current bucket's: staged values, keys noted the same, and this
	// member's own; opened at its first key in this call.
	var cur, curSame, live *bolt.Bucket
	opened := false
	open := func() error {
		if opened {
			return nil
		}
		opened = true
		live = tx.Bucket(d.bucket)
		if _, ok := d.merged[string(d.bucket)]; ok {
			var err error
			live, err = tx.CreateBucketIfNotExists(d.bucket)
			return err
		}
		if cur = vals.Bucket(d.bucket); cur == nil {
			return bad("key of a bucket the staging lost")
		}
		cur.FillPercent = 0.9 // keys arrive in order
		return nil
	}
	// noteSame notes k as this member's already; the bucket of notes is
	// made at the first (none: every key is staged).
	noteSame := func(k []byte) error {
		if curSame == nil {
			var err error
			if curSame, err = same.CreateBucketIfNotExists(d.bucket); err != nil {
				return err
			}
			curSame.FillPercent = 0.9
		}
		return curSame.Put(k, sameMark)
	}
items:
	for len(buf) > 0 {
		if !d.header {
			if len(buf) < len(snapshotMagic)+1+8 {
				break
			}
			if string(buf[:4]) != snapshotMagic {
				return bad("not a tandem snapshot")
			}
			if v := buf[4]; v != snapshotVersion {
				return fmt.Errorf("snapshot version %d, this build reads %d: %w", v, snapshotVersion, ErrUnknownVersion)
			}
			d.index, d.header, buf = binary.BigEndian.Uint64(buf[5:]), true, buf[13:]
			continue
		}
		if d.ended {
			return bad("data after the end")
		}
		rest := buf[1:]
		switch buf[0] {
		case 0:
			if err := d.endMerge(tx); err != nil {
				return err
			}
			d.ended, buf = true, rest
		case 1:
			name, after, ok, err := field(rest)
			if err != nil {
				return err
			}
			if !ok {
				break items
			}
			if len(name) == 0 {
				return bad("bucket name")
			}
			if ownBucket(name) {
				return bad(fmt.Sprintf("it carries the %s bucket, which is this member's own", name))
			}
			if err := d.endMerge(tx); err != nil {
				return err
			}
			if _, ok := d.merged[string(name)]; ok {
				return bad(fmt.Sprintf("bucket %s named again after it was merged", name))
			}
			// A bucket named twice: the last one wins, as it did
			// when installs wrote the buckets from the whole body.
			for _, b := range []*bolt.Bucket{vals, same} {
				if b.Bucket(name) != nil {
					if err := b.DeleteBucket(name); err != nil {
						return err
					}
				}
			}
			if _, err := vals.CreateBucket(name); err != nil {
				return err
			}
			cur, curSame, live, opened = nil, nil, nil, false
			d.bucket, buf = bytes.Clone(name), after
			d.diff[string(name)] = bucketDiff{}
			d.live = 0
			if b := tx.Bucket(name); b != nil {
				st := b.Stats()
				d.live = int64(st.LeafInuse + st.InlineBucketInuse)
			}
		case 2:
			k, after, ok, err := field(rest)
			if err != nil {
				return err
			}
			var v []byte
			if ok {
				if v, after, ok, err = field(after); err != nil {
					return err
				}
			}
			if !ok {
				break items
			}
			if d.bucket == nil || len(k) == 0 {
				return bad("key outside a bucket")
			}
			if err := open(); err != nil {
				return err
			}
			name := string(d.bucket)
			if pos, ok := d.merged[name]; ok {
				if pos.last != nil && bytes.Compare(k, pos.last) <= 0 {
					return bad(fmt.Sprintf("key %q of bucket %s out of order", k, name))
				}
				if err := mergeKey(live, pos.last, k, v); err != nil {
					return fmt.Errorf("%s/%q: %w", name, k, err)
				}
				d.merged[name] = mergePos{last: bytes.Clone(k)}
				buf = after
				continue
			}
			diff := d.diff[name]
			if lv := getValue(live, k); lv != nil && bytes.Equal(lv, v) {
				err = noteSame(k)
				diff.same += leafElem + int64(len(k)+len(v))
			} else {
				err = cur.Put(k, v)
				diff.changed += leafElem + int64(len(k)+len(v))
			}
			if err != nil {
				return fmt.Errorf("%s/%q: %w", d.bucket, k, err)
			}
			d.diff[name] = diff
			if live != nil && d.live > 0 && d.live >= d.minLive && (diff.changed*inPlaceShare > d.live || diff.changed > d.stageMax) {
				if err := d.startMerge(tx, vals, same, place, live, k); err != nil {
					return fmt.Errorf("merging bucket %s in place: %w", name, err)
				}
				cur, curSame = nil, nil
			}
			buf = after
		default:
			return bad(fmt.Sprintf("unknown tag %d", buf[0]))
		}
	}
	d.pending = bytes.Clone(buf)
	return nil
}

// startMerge turns the current bucket, staged up to and with its key
// last, to a merge in place (see the top of this file): this member's
// bucket live gets the values staged, loses the keys up to last that the
// snapshot lacks, and the staging of the bucket goes.
func (d *snapDecoder) startMerge(tx *bolt.Tx, vals, same, place, live *bolt.Bucket, last []byte) error {
	vb, sb := vals.Bucket(d.bucket), same.Bucket(d.bucket)
	if vb == nil {
		return fmt.Errorf("no staged values: %w", ErrCorrupt)
	}
	if err := mergeInto(live, vb, sb, last); err != nil {
		return err
	}
	if err := vals.DeleteBucket(d.bucket); err != nil {
		return err
	}
	if sb != nil {
		if err := same.DeleteBucket(d.bucket); err != nil {
			return err
		}
	}
	if _, err := place.CreateBucket(d.bucket); err != nil {
		return err
	}
	delete(d.diff, string(d.bucket))
	d.merged[string(d.bucket)] = mergePos{last: bytes.Clone(last)}
	return nil
}

// endMerge ends the current bucket's merge in place, if it is merged:
// the keys of this member's past the snapshot's last one go.
func (d *snapDecoder) endMerge(tx *bolt.Tx) error {
	pos, ok := d.merged[string(d.bucket)]
	if !ok || pos.done {
		return nil
	}
	if live := tx.Bucket(d.bucket); live != nil {
		if err := deleteBetween(live, pos.last, nil); err != nil {
			return fmt.Errorf("merging bucket %s in place: %w", d.bucket, err)
		}
	}
	d.merged[string(d.bucket)] = mergePos{last: pos.last, done: true}
	return nil
}

// mergeKey writes the snapshot's value v of k into live, a bucket merged
// in place whose merge wrote after last (nil: none yet), and deletes the
// keys between them, which the snapshot lacks.
func mergeKey(live *bolt.Bucket, after, k, v []byte) error {
	if err := deleteBetween(live, after, k); err != nil {
		return err
	}
	if old := live.Get(k); old != nil && bytes.Equal(old, v) {
		return nil
	}
	return live.Put(k, v)
}

// deleteBetween deletes b's keys after after (nil: from the first) and
// before before (nil: to the last).
func deleteBetween(b *bolt.Bucket, after, before []byte) error {
	c := b.Cursor()
	var k, v []byte
	if after == nil {
		k, v = c.First()
	} else if k, v = c.Seek(after); k != nil && bytes.Equal(k, after) {
		k, v = c.Next()
	}
	var gone [][]byte
	for ; k != nil && (before == nil || bytes.Compare(k, before) < 0); k, v = c.Next() {
		if v != nil {
			gone = append(gone, bytes.Clone(k))
		}
	}
	for _, k := range gone {
		if err := b.Delete(k); err != nil {
			return err
		}
	}
	return nil
}

// getValue is b's value of k, nil when b is nil or holds no such value.
func getValue(b *bolt.Bucket, k []byte) []byte {
	if b == nil {
		return nil
	}
	return b.Get(k)
}

// Finish checks the whole body against its ref and its own CRC, makes
// each bucket ready for the install (see the top of this file), and seals
// the staging: it returns the data to give raft's snapshot in place of
// the body (a staged ref). A damaged body is dropped.
func (in *SnapshotIn) Finish() ([]byte, error) {
	if !in.Done() {
		return nil, fmt.Errorf("storage: snapshot has %d of its %d bytes", in.off, in.ref.Size)
	}
	sum, stored := in.crc.Sum32(), binary.BigEndian.Uint32(in.tail)
	var bad string
	switch {
	case sum != stored || sum != in.ref.CRC:
		bad = fmt.Sprintf("CRC %08x, it says %08x, its ref %08x", sum, stored, in.ref.CRC)
	case !in.dec.ended || len(in.dec.pending) > 0:
		bad = "truncated"
	case in.dec.index != in.ref.Index:
		bad = fmt.Sprintf("its state is at index %d, its ref says %d", in.dec.index, in.ref.Index)
	}
	if bad != "" {
		in.Close()
		return nil, fmt.Errorf("storage: received snapshot: %s: %w", bad, ErrCorrupt)
	}
	err := in.db.commit(func(tx *bolt.Tx) error {
		vals, same, _, err := in.staging(tx)
		if err != nil {
			return err
		}
		for name, diff := range in.dec.diff {
			if diff.same > diff.changed {
				continue // installed as a difference
			}
			if err := fillSame(tx, vals, same, []byte(name)); err != nil {
				return err
			}
		}
		in.db.snapInMu.Lock()
		in.db.snapIn.sealed = in.ref
		in.db.snapInMu.Unlock()
		return nil
	})
	if err != nil {
		in.db.snapInMu.Lock()
		if in.db.snapIn.sealed == in.ref {
			in.db.snapIn.sealed = SnapshotRef{}
		}
		in.db.snapInMu.Unlock()
		return nil, fmt.Errorf("storage: received snapshot at %d: %w", in.ref.Index, err)
	}
	return in.ref.encodeStaged(), nil
}

// fillSame copies the values of bucket name this member holds already,
// and the snapshot too, into the staged bucket, which then holds the
// whole of the snapshot's, to be moved in place; the notes go.
func fillSame(tx *bolt.Tx, vals, same *bolt.Bucket, name []byte) error {
	sb := same.Bucket(name)
	if sb == nil {
		return nil
	}
	vb, live := vals.Bucket(name), tx.Bucket(name)
	if vb == nil || live == nil {
		return fmt.Errorf("staging of bucket %s: %w", name, ErrCorrupt)
	}
	c := sb.Cursor()
	for k, _ := c.First(); k != nil; k, _ = c.Next() {
		v := live.Get(k)
		if v == nil {
			return fmt.Errorf("staging of bucket %s: %q is noted the same as this member's, which lacks it: %w", name, k, ErrCorrupt)
		}
		if err := vb.Put(bytes.Clone(k), bytes.Clone(v)); err != nil {
			return err
		}
	}
	return same.DeleteBucket(name)
}

// keepSnapshotValue is called by a commit before it writes key of bucket
// (live, this member's) while a snapshot is received (same is the
// staging's snapInSame): if the snapshot's value of key is noted as the
// same as this member's, that value is copied into the staging first, so
// the install still finds it. A staging found wrong is dropped (the
// master sends the snapshot again) rather than failing the commit.
func (db *DB) keepSnapshotValue(tx *bolt.Tx, same, live *bolt.Bucket, bucket, key string) error {
	db.snapInMu.Lock()
	pos, merged := db.snapIn.merged[bucket]
	db.snapInMu.Unlock()
	if merged {
		if !pos.passed([]byte(key)) {
			return nil // the merge writes the snapshot's when it comes
		}
		kb := tx.Bucket(bucketSnapIn).Bucket(snapInPlace).Bucket([]byte(bucket))
		if kb == nil {
			db.log.Warn("a snapshot being merged in place lost what it keeps: dropping it, the master sends it again", "bucket", bucket)
			return db.dropStagingIn(tx)
		}
		if kb.Get([]byte(key)) != nil {
			return nil // kept at an earlier write
		}
		return kb.Put([]byte(key), keptValue(live.Get([]byte(key))))
	}
	sb := same.Bucket([]byte(bucket))
	if sb == nil || sb.Get([]byte(key)) == nil {
		return nil
	}
	v := live.Get([]byte(key))
	vb := tx.Bucket(bucketSnapIn).Bucket(snapInVals).Bucket([]byte(bucket))
	if v == nil || vb == nil {
		db.log.Warn("a snapshot being received noted a value this member lacks: dropping it, the master sends it again", "bucket", bucket, "key", key)
		return db.dropStagingIn(tx)
	}
	if err := vb.Put([]byte(key), bytes.Clone(v)); err != nil {
		return err
	}
	return sb.Delete([]byte(key))
}

// keptValue is how snapInPlace keeps a value of a bucket merged in place
// (nil: the snapshot lacks the key): a byte 1 before it, or a lone 0.
func keptValue(v []byte) []byte {
	if v == nil {
		return []byte{0}
	}
	return append([]byte{1}, v...)
}

// restoreKept writes back into this member's bucket name what the merge
// kept of it (keptValue) before the broker wrote there.
func restoreKept(tx *bolt.Tx, name []byte, kb *bolt.Bucket) error {
	live, err := tx.CreateBucketIfNotExists(name)
	if err != nil {
		return err
	}
	c := kb.Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		switch {
		case len(v) == 1 && v[0] == 0:
			err = live.Delete(k)
		case len(v) >= 1 && v[0] == 1:
			err = live.Put(bytes.Clone(k), bytes.Clone(v[1:]))
		default:
			err = fmt.Errorf("kept value of %q: %w", k, ErrCorrupt)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// InstallInterrupted reports whether the broker state holds part of a
// snapshot merged in place (see the top of snapin.go) that no install
// completed: a crash, a cut pull or a damaged body came between. It is
// incomplete until a snapshot installs.
func (db *DB) InstallInterrupted() bool { return db.installing.Load() }

// loadInstalling reads keyInstalling at Open.
func (db *DB) loadInstalling() error {
	return db.bolt.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketMeta).Get(keyInstalling); v != nil {
			db.installing.Store(true)
			ref, _ := ParseSnapshotRef(v)
			db.log.Warn("a snapshot was being merged into the broker state when this member stopped: that state is incomplete, neither applied to nor served, until the master sends a snapshot again and it is installed",
				"snapshot_index", ref.Index)
		}
		return nil
	})
}

// Close ends the receiving: the staging is deleted, unless an install or
// a newer receiving took it already. An install of what Finish sealed
// must come first.
func (in *SnapshotIn) Close() {
	if !in.current() {
		return // taken already: no commit to find that out again
	}
	err := in.db.commit(func(tx *bolt.Tx) error {
		if !in.current() {
			return nil
		}
		return in.db.dropStagingIn(tx)
	})
	if err != nil && !errors.Is(err, ErrClosed) {
		in.db.log.Warn("dropping a snapshot received in part failed: the next one received drops it", "error", err)
	}
}

// dropStagingIn deletes the staging in tx, and ends the receiving that
// owned it.
func (db *DB) dropStagingIn(tx *bolt.Tx) error {
	db.snapInMu.Lock()
	db.snapIn.gen++
	db.snapIn.sealed = SnapshotRef{}
	db.snapIn.merged = nil
	db.snapInMu.Unlock()
	if tx.Bucket(bucketSnapIn) == nil {
		return nil
	}
	return tx.DeleteBucket(bucketSnapIn)
}

// stageSnapshot stages a snapshot at index that came whole in raft's
// message, as a pulled one is, and returns its staged ref.
func (db *DB) stageSnapshot(data []byte, index uint64) (SnapshotRef, error) {
	applied, _, err := decodeSnapshot(data) // checked whole before anything is dropped
	if err != nil {
		return SnapshotRef{}, err
	}
	if applied != index {
		return SnapshotRef{}, fmt.Errorf("its state is at index %d, its metadata says %d: %w", applied, index, ErrCorrupt)
	}
	ref := SnapshotRef{Index: applied, Size: uint64(len(data)), CRC: binary.BigEndian.Uint32(data[len(data)-4:])}
	in, err := db.ReceiveSnapshot(ref)
	if err != nil {
		return ref, err
	}
	if err := in.Write(data); err != nil {
		in.Close()
		return ref, err
	}
	if _, err := in.Finish(); err != nil {
		in.Close()
		return ref, err
	}
	return ref, nil
}

// installStaged puts the staged buckets in place of this member's, in tx
// (see the top of this file), and drops the staged writes to them: those
// were made on the state the snapshot replaces. ref must be what the
// staging holds, sealed.
func (db *DB) installStaged(tx *bolt.Tx, ref SnapshotRef) error {
	if !db.SnapshotStaged(ref) {
		return fmt.Errorf("the snapshot at %d is not the one received here: %w", ref.Index, ErrSnapshotGone)
	}
	st := tx.Bucket(bucketSnapIn)
	var vals, same, place *bolt.Bucket
	if st != nil {
		vals, same, place = st.Bucket(snapInVals), st.Bucket(snapInSame), st.Bucket(snapInPlace)
	}
	if vals == nil || same == nil || place == nil {
		return fmt.Errorf("the snapshot at %d received here is gone: %w", ref.Index, ErrCorrupt)
	}
	// Names first: the moves change the bucket the cursor walks. A
	// bucket to move is not opened in this transaction: MoveBucket
	// moves a bucket as its parent stores it, without the changes made
	// to it meanwhile.
	var names [][]byte
	c := vals.Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if v == nil {
			names = append(names, bytes.Clone(k))
		}
	}
	installed := map[string]bool{}
	// The buckets merged in place hold the snapshot's already, but for
	// what the broker wrote over it since.
	c = place.Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if v != nil {
			continue
		}
		if err := restoreKept(tx, k, place.Bucket(k)); err != nil {
			return fmt.Errorf("installing the bucket %s merged in place: %w", k, err)
		}
		installed[string(k)] = true
	}
	if err := tx.Bucket(bucketMeta).Delete(keyInstalling); err != nil {
		return err
	}
	for _, name := range names {
		installed[string(name)] = true
		if sb := same.Bucket(name); sb != nil {
			if err := applyDiff(tx, name, vals.Bucket(name), sb); err != nil {
				return fmt.Errorf("installing the received bucket %s: %w", name, err)
			}
			continue
		}
		if tx.Bucket(name) != nil {
			if err := tx.DeleteBucket(name); err != nil {
				return err
			}
		}
		if err := tx.MoveBucket(name, vals, nil); err != nil {
			return fmt.Errorf("moving the received bucket %s in place: %w", name, err)
		}
	}
	if err := db.dropStagingIn(tx); err != nil {
		return err
	}
	db.stageMu.Lock()
	for k, op := range db.staged {
		if installed[op.bucket] {
			delete(db.staged, k)
		}
	}
	db.fresh = slices.DeleteFunc(db.fresh, func(op stagedOp) bool { return installed[op.bucket] })
	db.stageMu.Unlock()
	return nil
}

// applyDiff makes this member's bucket name the snapshot's: the staged
// values vb written, the keys the snapshot lacks (in neither vb nor the
// notes sb) deleted, those noted the same kept.
func applyDiff(tx *bolt.Tx, name []byte, vb, sb *bolt.Bucket) error {
	if vb == nil {
		return fmt.Errorf("no staged values: %w", ErrCorrupt)
	}
	live, err := tx.CreateBucketIfNotExists(name)
	if err != nil {
		return err
	}
	return mergeInto(live, vb, sb, nil)
}

// mergeInto writes the staged values vb into live and deletes the keys of
// live (up to and with last, all of them when last is nil) that are in
// neither vb nor the notes of values kept the same, sb (which may be nil).
func mergeInto(live, vb, sb *bolt.Bucket, last []byte) error {
	var gone [][]byte
	c := live.Cursor()
	for k, v := c.First(); k != nil && (last == nil || bytes.Compare(k, last) <= 0); k, v = c.Next() {
		if v != nil && vb.Get(k) == nil && (sb == nil || sb.Get(k) == nil) {
			gone = append(gone, bytes.Clone(k))
		}
	}
	for _, k := range gone {
		if err := live.Delete(k); err != nil {
			return err
		}
	}
	c = vb.Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if err := live.Put(bytes.Clone(k), bytes.Clone(v)); err != nil {
			return err
		}
	}
	return nil
}

// dropStaging deletes a staging an earlier run left (nothing resumes it:
// the master sends the snapshot again).
func (db *DB) dropStaging() error {
	var left bool
	_ = db.bolt.View(func(tx *bolt.Tx) error { left = tx.Bucket(bucketSnapIn) != nil; return nil })
	if !left {
		return nil
	}
	return db.commit(db.dropStagingIn)
}
