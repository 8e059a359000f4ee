package mqtt

// The session byte cap (DESIGN.md, "Budgets").
//
// Persistent sessions are state the log's retention cannot drop: every
// member keeps each one in its data file, inside storage.max_bytes. Their
// count is capped (max_sessions, max_filters_per_session); their bytes are
// capped by Limits.MaxSessionBytes, counted as the data file holds them,
// pages included (storedSize): the session record and cursor (keyed by
// client id), each subscription (keyed by client id and filter). Messages in flight and QoS 2 markers
// are not counted: the windows (max_inflight_out, receive maximum) bound
// them, and counting them would cost every ack.
//
// Like max_sessions the count is the cluster's: every member holds every
// persistent session. A new persistent session or a new filter that would
// pass the cap is refused on the member that takes it (CONNACK or SUBACK
// 0x97); resuming, replacing and removing are always taken, and what
// other members' records bring is applied whatever the count, as every
// member must hold the same.

// The JSON of a session's and a subscription's record beyond their
// strings, at their widest (72 and 94 bytes): their values in the data
// file, which storedSize turns into pages.
const (
	sessionRecJSON = 84 // with "user":"" too
	subRecJSON     = 100
)

// sessionRecSize is what a persistent session's record and cursor
// count from feature level 3 on (counts.go), before its subscriptions:
// the pages they take in the data file.
func sessionRecSize(id, user string) int64 {
	return storedSize(len(keySession)+len(id), sessionRecJSON+jsonLen(user)) +
		storedSize(len(keyCursor)+len(id), 8)
}

// subRecSize is what one subscription counts: the pages its record
// takes in the data file.
func subRecSize(id, filter string) int64 {
	return storedSize(len(subKey(id, filter)), subRecJSON)
}

// Reasons a session is refused for max_session_bytes, as logged and
// counted.
const (
	whySessionBytes    = "session bytes at max_session_bytes: CONNECT refused"
	whySessionSubBytes = "session bytes at max_session_bytes"
)

// sizeLocked is what se counts now, by the rule pages says (counts.go).
// Called with se.mu held.
func (se *session) sizeLocked(pages bool) int64 {
	if !se.persistent() || se.ended {
		return 0
	}
	n := sessionRecCount(se.id, se.user, pages)
	for f := range se.subs {
		n += subRecCount(se.id, f, pages)
	}
	return n
}

// recount brings se's part of the session bytes up to date; every change
// to a session's persistence, user or subscriptions calls it.
func (s *Server) recount(se *session) {
	se.mu.Lock()
	defer se.mu.Unlock()
	s.recountLocked(se)
}

// recountLocked is recount with se.mu held.
func (s *Server) recountLocked(se *session) {
	n := se.sizeLocked(s.pageCounts.Load()) // read under se.mu: a change of rule recounts se after it
	if d := n - se.bytes; d != 0 {
		se.bytes = n
		s.sessionBytes.Add(d)
	}
}

// sessionRoom reports whether grow more bytes of session state fit
// within max_session_bytes, the bytes of a session about to go (free)
// given back.
func (s *Server) sessionRoom(grow, free int64) bool {
	return s.sessionBytes.Load()-free+grow <= s.cfg.Limits.MaxSessionBytes
}

// SessionBytes is what the persistent sessions count against
// max_session_bytes, for metrics.
func (s *Server) SessionBytes() int64 { return s.sessionBytes.Load() }
