package storage

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	pb "go.etcd.io/raft/v3/raftpb"
)

// Reading a format 6 chain that failed its checks, for Repair,
// SurveyDamaged and RequeueSalvaged: frame by frame past a damaged one,
// and segment by segment past a lost cut (a cut names the id the next
// segment's frames carry, and nextSegmentID derives it when the cut is
// gone). It holds no entry in memory beyond one segment's: a first pass
// notes which frames hold the log (an overwrite drops what it overwrites,
// as at Open), a second reads their entries again, in order.

// chainFrameRef is a frame of the chain whose entries first..last are the
// log's.
type chainFrameRef struct {
	seq, id     uint64
	off         int64
	first, last uint64
}

// chainSalvage is what a first pass over a chain read.
type chainSalvage struct {
	dir    string
	frames []chainFrameRef
	// live are the frames at or past the replay point, without their
	// entries: their metadata writes and hard states, in order.
	live      []walFrame
	bad       []string // what could not be read, in words
	last      uint64   // the last index of the log read, 0 if none
	firstTerm uint64   // the term of the first entry read
}

// salvageChain reads the chain of dir from its head (seq head, carrying
// id), the replay point at (replaySeq, replayOff).
func salvageChain(dir string, head, id, replaySeq uint64, replayOff int64) *chainSalvage {
	c := &chainSalvage{dir: dir}
	seq := head
	for id != 0 {
		path := walPath(dir, int(seq))
		seg, err := openWAL(path, true, true)
		if err != nil {
			if !errors.Is(err, fs.ErrNotExist) {
				c.bad = append(c.bad, fmt.Sprintf("%s: %v", path, err))
			}
			break
		}
		frames, bad := seg.salvageFrames(id)
		seg.f.Close()
		for _, b := range bad {
			c.bad = append(c.bad, fmt.Sprintf("%s: %s", path, b))
		}
		next := uint64(0)
		for _, fr := range frames {
			if fr.next != 0 {
				next = fr.next
				continue
			}
			if seq > replaySeq || (seq == replaySeq && fr.off >= replayOff) {
				meta := fr
				meta.ents = nil
				c.live = append(c.live, meta)
			}
			if len(fr.ents) == 0 {
				continue
			}
			first, last := fr.ents[0].Index, fr.ents[len(fr.ents)-1].Index
			if first <= c.last {
				c.truncate(first) // an overwrite, by a later term
			}
			if len(c.frames) == 0 {
				c.firstTerm = fr.ents[0].Term
			}
			c.frames = append(c.frames, chainFrameRef{seq: seq, id: id, off: fr.off, first: first, last: last})
			c.last = last
		}
		if next == 0 {
			// The chain's end, or a cut lost to damage: then a later
			// segment holds frames under the id a cut from here on
			// named (chainGoesOn).
			k, kid, _ := nextChainSegment(dir, seq, id)
			if k == 0 {
				break
			}
			c.bad = append(c.bad, fmt.Sprintf("%s: the frames before its cut to the next segment (damaged; their records are listed as lost)", path))
			for s := seq + 1; s < k; s++ {
				c.bad = append(c.bad, fmt.Sprintf("%s: missing or unreadable", walPath(dir, int(s))))
			}
			seq, id = k, kid
			continue
		}
		seq, id = seq+1, next
	}
	return c
}

// truncate drops the frames' entries from index i on.
func (c *chainSalvage) truncate(i uint64) {
	n := len(c.frames)
	for n > 0 && c.frames[n-1].first >= i {
		n--
	}
	c.frames = c.frames[:n]
	if n > 0 && c.frames[n-1].last >= i {
		c.frames[n-1].last = i - 1
	}
	c.last = i - 1
}

// each calls fn with the log's entries, in index order, reading the
// frames again; a frame that no longer reads as it did is an error.
func (c *chainSalvage) each(fn func(e pb.Entry) error) error {
	var b []byte
	seq := uint64(0)
	for _, r := range c.frames {
		if b == nil || r.seq != seq {
			var err error
			if b, err = os.ReadFile(walPath(c.dir, int(r.seq))); err != nil {
				return fmt.Errorf("storage: %w", err)
			}
			seq = r.seq
		}
		p, ok := frameAt(b, r.off, r.id)
		if !ok {
			return fmt.Errorf("%s: the frame at offset %d changed while it was read: %w", walPath(c.dir, int(r.seq)), r.off, ErrCorrupt)
		}
		fr, err := decodeFrame(p)
		if err != nil {
			return fmt.Errorf("%s: frame at offset %d: %v: %w", walPath(c.dir, int(r.seq)), r.off, err, ErrCorrupt)
		}
		for _, e := range fr.ents {
			if e.Index < r.first || e.Index > r.last {
				continue
			}
			if err := fn(e); err != nil {
				return err
			}
		}
	}
	return nil
}
