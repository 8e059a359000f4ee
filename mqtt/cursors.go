package mqtt

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"sort"
)

// Cursor records.
//
// A cursor record tells the other members how far the persistent
// sessions live here have got. Builds before feature level 2 wrote, and
// v0.1.0 reads only, a JSON object of client id to cursor: with long
// client ids, and a record every cursorEvery, that repeated the ids into
// the log over and over (issue 31: 1,185 MB in 5 s for 100 sessions of
// 60 KB ids). From level 2 on the record names a session by its ref, the
// log index of its latest start record, which every member applied at the
// same index: a few bytes whatever the id.
//
// The compact payload: cursorsCompact, a byte no JSON text starts with;
// the count of ref entries (uvarint); per entry, in ascending ref order,
// the ref's distance from the previous one (uvarint) and the cursor's from
// the previous cursor (varint: cursors of live sessions are close to each
// other); then, to the end, the sessions with no ref (their start record
// was not logged, or logged before level 2): the id's length (uvarint),
// the id, and the cursor (uvarint).
const cursorsCompact = 0x01

// cursorBatch is one cursor record's content.
type cursorBatch struct {
	byRef map[uint64]uint64 // ref → cursor
	byID  map[string]uint64 // client id → cursor, for sessions with no ref
}

func (b *cursorBatch) empty() bool { return len(b.byRef) == 0 && len(b.byID) == 0 }

// encodeCursors encodes b compactly (members below feature level 2 get
// the JSON object of b.byID instead: replicateCursors).
func encodeCursors(b *cursorBatch) []byte {
	refs := make([]uint64, 0, len(b.byRef))
	for r := range b.byRef {
		refs = append(refs, r)
	}
	sort.Slice(refs, func(i, j int) bool { return refs[i] < refs[j] })
	out := binary.AppendUvarint([]byte{cursorsCompact}, uint64(len(refs)))
	var prevRef, prevCur uint64
	for _, r := range refs {
		cur := b.byRef[r]
		out = binary.AppendUvarint(out, r-prevRef)
		out = binary.AppendVarint(out, int64(cur-prevCur))
		prevRef, prevCur = r, cur
	}
	ids := make([]string, 0, len(b.byID))
	for id := range b.byID {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		out = binary.AppendUvarint(out, uint64(len(id)))
		out = append(out, id...)
		out = binary.AppendUvarint(out, b.byID[id])
	}
	return out
}

var errCursors = errors.New("cursor record: bad encoding")

// decodeCursors reads a cursor record of either encoding.
func decodeCursors(p []byte) (*cursorBatch, error) {
	if len(p) == 0 || p[0] != cursorsCompact {
		var ids map[string]uint64
		if err := json.Unmarshal(p, &ids); err != nil {
			return nil, err
		}
		return &cursorBatch{byID: ids}, nil
	}
	p = p[1:]
	uv := func() (uint64, bool) {
		v, n := binary.Uvarint(p)
		if n <= 0 {
			return 0, false
		}
		p = p[n:]
		return v, true
	}
	count, ok := uv()
	if !ok || count > uint64(len(p)) { // an entry takes two bytes at least
		return nil, errCursors
	}
	b := &cursorBatch{byRef: make(map[uint64]uint64, count)}
	var ref, cur uint64
	for i := uint64(0); i < count; i++ {
		d, ok := uv()
		if !ok {
			return nil, errCursors
		}
		dc, n := binary.Varint(p)
		if n <= 0 {
			return nil, errCursors
		}
		p = p[n:]
		ref, cur = ref+d, cur+uint64(dc)
		b.byRef[ref] = cur
	}
	for len(p) > 0 {
		n, ok := uv()
		if !ok || n > uint64(len(p)) {
			return nil, errCursors
		}
		id := string(p[:n])
		p = p[n:]
		c, ok := uv()
		if !ok {
			return nil, errCursors
		}
		if b.byID == nil {
			b.byID = map[string]uint64{}
		}
		b.byID[id] = c
	}
	return b, nil
}

// legacyControl reports whether control records are written as builds
// before feature level 2 read them (ControlEncoding); a Log that does not
// say has no such members.
func (s *Server) legacyControl() bool {
	e, ok := s.log.(ControlEncoding)
	return ok && e.LegacyControl()
}

// setRefLocked makes index se's ref, the number cursor records name it
// by, when every member reads the compact encoding at index: a member of
// an earlier build applying the same start record keeps no ref, and would
// not know it once upgraded. Called with s.mu held, not se.mu.
func (s *Server) setRefLocked(se *session, index uint64) {
	se.mu.Lock()
	old := se.ref
	se.ref = 0
	if !s.legacyControl() {
		se.ref = index
	}
	ref := se.ref
	se.mu.Unlock()
	if old != 0 && s.refs[old] == se {
		delete(s.refs, old)
	}
	if ref != 0 {
		if s.refs == nil {
			s.refs = map[uint64]*session{}
		}
		s.refs[ref] = se
	}
}

// byRefLocked is the session whose ref is ref, nil when none is. Called
// with s.mu held.
func (s *Server) byRefLocked(ref uint64) *session {
	se := s.refs[ref]
	if se == nil || s.sessions[se.id] != se {
		return nil
	}
	se.mu.Lock()
	ok := se.ref == ref && !se.ended
	se.mu.Unlock()
	if !ok {
		return nil
	}
	return se
}

// applyCursors applies a committed cursor record from another member to
// the offline copies of its sessions here.
func (s *Server) applyCursors(b *cursorBatch) {
	s.mu.Lock()
	var moved []*session
	move := func(se *session, cur uint64) {
		if se == nil {
			return
		}
		se.mu.Lock()
		if se.conn == nil && cur > se.cursor {
			se.cursor, se.scanned, se.sentCursor = cur, cur, cur
			moved = append(moved, se)
		}
		done := se.completedLocked()
		se.mu.Unlock()
		for _, pid := range done {
			s.stageDelete(outKey(se.id, pid))
		}
	}
	for ref, cur := range b.byRef {
		move(s.byRefLocked(ref), cur)
	}
	for id, cur := range b.byID {
		move(s.sessions[id], cur)
	}
	s.mu.Unlock()
	for _, se := range moved {
		s.saveCursor(se)
	}
}
