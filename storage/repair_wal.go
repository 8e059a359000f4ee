package storage

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"slices"

	pb "go.etcd.io/raft/v3/raftpb"
)

// Replaying what the damaged WAL still holds over the repaired log.

// loadWAL reads the WAL's live frames, frame by frame past a damaged one:
// their metadata writes over what the file held, their entries kept for
// write to append after the file's.
func (s *salvager) loadWAL() {
	w, err := openWALs(s.src, true, false)
	if err != nil {
		s.rep.Unreadable = append(s.rep.Unreadable, fmt.Sprintf("the WAL: %v", err))
		return
	}
	defer w.close()
	if !s.walOK {
		s.guessWAL(w)
		return
	}
	seg, id := s.walSeg, s.walID
	for hop := 0; hop < 2 && id != 0; hop++ {
		frames, bad := w.segs[seg].salvageFrames(id)
		for _, b := range bad {
			s.rep.Unreadable = append(s.rep.Unreadable, fmt.Sprintf("%s: %s", walPath(s.src, seg), b))
		}
		next := uint64(0)
		for _, fr := range frames {
			if fr.next != 0 {
				next = fr.next
				continue
			}
			s.takeFrame(fr)
		}
		if next == 0 {
			break
		}
		seg, id = 1-seg, next
	}
}

// loadChain reads a format 6 data dir's log from its segments, past
// damage: the frames at or past the replay point give their metadata
// writes over what the file held, as loadWAL's do, and write appends the
// entries of all of them.
func (s *salvager) loadChain() {
	head, id := s.segHead, s.segHeadID
	replaySeq, replayOff := uint64(s.walSeg), s.walOff
	if head == 0 || !s.walOK {
		// The data file no longer says where the chain starts, or
		// from where its frames are live: from the oldest segment
		// there, every frame's metadata, the newest last.
		head, id = guessChainHead(s.src)
		replaySeq, replayOff = 0, 0
		if head == 0 {
			s.rep.Unreadable = append(s.rep.Unreadable, "the log: no segment of it in the data dir")
			return
		}
		s.rep.Notes = append(s.rep.Notes, fmt.Sprintf("The data file no longer says where its log's segments start: they were read from the oldest one there (%s), every frame's metadata replayed, the newest last.", walPath(s.src, int(head))))
	}
	c := salvageChain(s.src, head, id, replaySeq, replayOff)
	s.rep.Unreadable = append(s.rep.Unreadable, c.bad...)
	for _, fr := range c.live {
		s.takeFrame(fr)
	}
	s.chain = c
}

// hasSegments says whether dir holds segments of format 6: a data file
// too damaged to say its format may be one.
func hasSegments(dir string) bool {
	seq, _ := guessChainHead(dir)
	return seq != 0
}

// lastSegment returns the highest seq of a WAL file in dir, 0 if none.
func lastSegment(dir string) uint64 {
	seqs := walSeqs(dir)
	if len(seqs) == 0 {
		return 0
	}
	return seqs[len(seqs)-1]
}

// guessChainHead returns the oldest segment in dir whose first frame
// checks out and that leads on to the next one (the segment after it
// holds a frame under the id a cut from it names), or is the last such
// segment; and its id; 0 if none. A dropped segment kept for reuse has a
// deleted one after it, unless it was the head's predecessor: then the
// chain read from it holds records retention had dropped, older than the
// rest and contiguous with it.
func guessChainHead(dir string) (seq, id uint64) {
	type cand struct{ seq, id uint64 }
	var cands []cand
	for _, k := range walSeqs(dir) {
		if k < firstSegment {
			continue
		}
		b, err := os.ReadFile(walPath(dir, int(k)))
		if err != nil || len(b) < walHdr {
			continue
		}
		id := binary.LittleEndian.Uint64(b[8:])
		if _, ok := frameAt(b, 0, id); ok && id != 0 {
			cands = append(cands, cand{k, id})
		}
	}
	for i, c := range cands {
		if i == len(cands)-1 {
			return c.seq, c.id
		}
		if b, err := os.ReadFile(walPath(dir, int(c.seq+1))); err == nil {
			if _, ok := findFrame(b, 0, nextSegmentID(c.id)); ok {
				return c.seq, c.id
			}
		}
	}
	return 0, 0
}

// guessWAL reads the WAL when the data file no longer says which of its
// frames are live: each file's frames under the id of its first one,
// the file whose entries are older first. Entries are added by index, so
// those the data file holds already are skipped.
func (s *salvager) guessWAL(w *walLog) {
	type segFrames struct {
		first  uint64
		frames []walFrame
	}
	var segs []segFrames
	for i := range w.segs {
		seg := &w.segs[i]
		var hdr [walHdr]byte
		if seg.f == nil || seg.size < walHdr {
			continue
		}
		if _, err := seg.f.ReadAt(hdr[:], 0); err != nil {
			continue
		}
		frames, _ := seg.salvageFrames(binary.LittleEndian.Uint64(hdr[8:]))
		sf := segFrames{frames: frames}
		for _, fr := range frames {
			if len(fr.ents) > 0 {
				sf.first = fr.ents[0].Index
				break
			}
		}
		if len(frames) > 0 {
			segs = append(segs, sf)
		}
	}
	slices.SortFunc(segs, func(a, b segFrames) int { return cmp.Compare(a.first, b.first) })
	for _, sf := range segs {
		for _, fr := range sf.frames {
			if fr.next != 0 {
				continue
			}
			s.takeFrame(fr)
		}
	}
	slices.SortStableFunc(s.walEnts, func(a, b pb.Entry) int { return cmp.Compare(a.Index, b.Index) })
	if len(segs) > 0 {
		s.rep.Notes = append(s.rep.Notes, "The data file no longer says which WAL frames are live: every frame that checks out was read, the newest last.")
	}
}

// takeFrame takes one live frame that is not a cut.
func (s *salvager) takeFrame(fr walFrame) {
	s.rep.WALFrames++
	for _, op := range fr.ops {
		s.walOp(op)
	}
	s.walEnts = append(s.walEnts, fr.ents...)
	if fr.hs != nil {
		s.hs, s.hsOK = *fr.hs, true
	}
}

// walOp takes a replayed metadata write: the raft state and the keys
// Repair sets itself are read, the rest is staged after the buckets.
func (s *salvager) walOp(op stagedOp) {
	switch {
	case op.bucket == string(bucketRaftState) && op.key == string(keyHardState) && op.val != nil:
		var hs pb.HardState
		if hs.Unmarshal(op.val) == nil {
			s.hs, s.hsOK = hs, true
		}
	case op.bucket == string(bucketRaftState) && op.key == string(keyConfState) && op.val != nil:
		var cs pb.ConfState
		if cs.Unmarshal(op.val) == nil {
			s.cs, s.csOK = cs, true
			s.rep.Members = len(cs.Voters) + len(cs.Learners)
		}
	case op.bucket == string(bucketRaftState):
	case op.bucket == string(bucketMeta) && op.key == string(keyApplied):
		if len(op.val) == 8 {
			s.applied = binary.BigEndian.Uint64(op.val)
		}
	case op.bucket == string(bucketMeta) && op.key == string(keyEpoch):
		if len(op.val) == 8 {
			s.epoch = max(s.epoch, binary.BigEndian.Uint64(op.val))
		}
	case op.bucket == string(bucketMeta) && (op.key == string(keyFormat) || op.key == string(keyFormatRest) || op.key == string(keyWAL) || op.key == string(keyNodeID)):
	default:
		s.walOps = append(s.walOps, op)
	}
}

// salvageFrames returns the frames carrying id from the start of the file
// up to a cut, skipping a damaged frame when a good one follows it (where
// Open refuses), and what it skipped, in words.
func (w *walSeg) salvageFrames(id uint64) ([]walFrame, []string) {
	if w.f == nil || w.size == 0 || id == 0 {
		return nil, nil
	}
	b := make([]byte, w.size)
	if _, err := w.f.ReadAt(b, 0); err != nil && err != io.EOF {
		return nil, []string{fmt.Sprintf("read: %v", err)}
	}
	var frames []walFrame
	var bad []string
	off := int64(0)
	for off < int64(len(b)) {
		at := off
		payload, ok := frameAt(b, at, id)
		if !ok {
			payload, at, ok = paddedAt(b, off, id)
		}
		if ok {
			fr, err := decodeFrame(payload)
			if err == nil {
				off = at
				fr.off = off
				frames = append(frames, fr)
				off += walHdr + int64(len(payload))
				if fr.next != 0 {
					break
				}
				continue
			}
		}
		// A bad frame: the end of the log, unless a good one follows.
		nextGood, ok := findFrame(b, off+1, id)
		if !ok {
			break
		}
		bad = append(bad, fmt.Sprintf("bytes %d to %d (damaged frames; their records are listed as lost)", off, nextGood-1))
		off = nextGood
	}
	return frames, bad
}
