package mqtt

import "encoding/base64"

// Which rule the caps on the broker's state count by (issue #32).
//
// max_retained_bytes and max_session_bytes count what the records take of
// the data file's pages (pages.go) from the cluster's feature level 3 on
// (storage.FeaturePageCounts); below it they count the records' bytes, as
// the builds before it do. The cap on retained messages is a rule of the
// replicated state: every member applies it at apply time to the same
// committed state, and a record past it is delivered but not retained. In
// a cluster that mixes the builds during a rolling upgrade, members
// counting differently would retain different messages, so the new count
// waits, as a new record format does, for every member to run a build that
// knows it (DESIGN.md, "Versions and upgrades").
//
// The rule follows the level at the log position applied: the level moves
// on the apply goroutine between records (replication's PageCounts), and
// the applier asks it before each cap it applies (followCounts). At the
// switch every member recounts everything it holds at once: each retained
// message and each session counts by the new rule from that position on.
// The other choice, each entry keeping the size it was admitted at, would
// make a count depend on when an entry was set, which a member restarting
// or installing a snapshot does not know (the records carry no level, and
// storing one would change their format below the level that allows it).
// Recounting makes what a member counts a function of its state and the
// level alone, and both are what the log (or the snapshot) holds at that
// position: a member that restarts loads the state and the level its data
// file holds together and counts by that level; one that installs a
// snapshot takes the snapshot's level with its state. A recount may leave
// the retained messages over their cap (pages count more than bytes):
// every member is over it alike, keeps them, and retains no new topic
// until clears make room, as after a lowered cap. The level also falls
// back when a join wipes a member's raft state; the rule follows it either
// way.
//
// Below feature level 2 a member may run v0.1.0, which has no caps on
// retained messages at all and retains every retained record it applies.
// There the caps are not applied at apply either (capsApplied): a record
// past them that reaches the log (from a v0.1.0 member, which admits
// anything, or past a racing publish) is retained on every member, as
// v0.1.0 retains it. They are still counted, in bytes, and a publish taken
// by a member of this build is still refused past them.
//
// A publish's admission on the member that takes it (before it is logged)
// counts by the rule that member applies now: a refusal there is a
// courtesy to the publisher; the rule at apply decides.

// CapRules is a Log that knows how the cluster's caps on the broker's
// state apply at the log position the applier is at. A Log without it has
// no members of earlier builds: caps applied, in pages.
type CapRules interface {
	// PageCounts reports whether the caps count pages (feature level 3
	// or above), not bytes.
	PageCounts() bool
	// CapsApplied reports whether the caps on retained messages are
	// applied at apply (feature level 2 or above: no member runs
	// v0.1.0).
	CapsApplied() bool
}

// logRules is how the log says the caps apply now.
func (s *Server) logRules() (pages, capped bool) {
	if r, ok := s.log.(CapRules); ok {
		return r.PageCounts(), r.CapsApplied()
	}
	return true, true
}

// followCounts brings the rules of the caps to the log's, recounting the
// retained messages and sessions when the count changes. Called on the
// apply goroutine before a cap is applied (retain, applyControl), without
// s.mu.
func (s *Server) followCounts() {
	pages, capped := s.logRules()
	if s.capsApplied.Load() != capped {
		s.capsApplied.Store(capped)
		if capped {
			s.lines.Info("max_retained and max_retained_bytes are applied to the records applied from here on (feature level 2: no member runs v0.1.0)")
		}
	}
	if s.pageCounts.Load() == pages {
		return
	}
	was := s.retained.size()
	s.pageCounts.Store(pages) // before the recounts: one racing them counts by it too
	now := s.retained.countBy(pages)
	s.mu.Lock()
	ses := make([]*session, 0, len(s.sessions))
	for _, se := range s.sessions {
		ses = append(ses, se)
	}
	s.mu.Unlock()
	for _, se := range ses {
		s.recount(se)
	}
	rule := "bytes (the cluster runs below feature level 3)"
	if pages {
		rule = "pages (feature level 3)"
	}
	s.lines.Info("max_retained_bytes and max_session_bytes count "+rule+" from here on; recounted", "retained_bytes_was", was, "retained_bytes", now,
		"max_retained_bytes", s.cfg.Limits.MaxRetainedBytes, "session_bytes", s.sessionBytes.Load())
}

// resetCounts sets the rule to the log's while the broker holds no state
// (at start, and when a snapshot replaces it), before it is loaded.
func (s *Server) resetCounts() {
	pages, capped := s.logRules()
	s.capsApplied.Store(capped)
	s.pageCounts.Store(pages)
	s.retained.countBy(pages)
}

// The counts below feature level 3, as the builds before it count:
// overheads beyond the strings a record holds (its key, the JSON around
// it, its entry in memory). They must not change: members of those builds
// apply the cap on retained messages by them.
const (
	retainedOverheadBytes   = 256
	sessionRecOverheadBytes = 128
	subRecOverheadBytes     = 96
)

// retainedBytes is what a retained message counts below feature level 3:
// about its record's bytes (the payload in base64).
func retainedBytes(m *Message) int64 {
	b64 := base64.StdEncoding.EncodedLen
	n := retainedOverheadBytes + len(m.Topic) + len(m.ClientID) + b64(len(m.Payload)) +
		len(m.ContentType) + len(m.ResponseTopic) + b64(len(m.CorrelationData))
	for _, u := range m.User {
		n += len(u.Key) + len(u.Val) + 16
	}
	return int64(n)
}

// retainedSizes is what m counts by the rule pages says, and by the other.
func retainedSizes(m *Message, pages bool) (size, other int64) {
	p, b := retainedSize(m), retainedBytes(m)
	if pages {
		return p, b
	}
	return b, p
}

// sessionRecCount is what a persistent session's record and cursor count
// by the rule pages says.
func sessionRecCount(id, user string, pages bool) int64 {
	if pages {
		return sessionRecSize(id, user)
	}
	return int64(sessionRecOverheadBytes + 2*len(id) + len(user))
}

// subRecCount is what one subscription counts by the rule pages says.
func subRecCount(id, filter string, pages bool) int64 {
	if pages {
		return subRecSize(id, filter)
	}
	return int64(subRecOverheadBytes + len(id) + len(filter))
}
