package mqtt

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
)

// levelLog is a Log at a feature level the test sets (CapRules): below 3
// the caps on the broker's state count bytes, below 2 the retained caps
// are not applied at apply. Records are applied by the test, as the
// applier hands them over.
type levelLog struct{ level atomic.Int32 }

func newLevelLog(level int32) *levelLog {
	l := &levelLog{}
	l.level.Store(level)
	return l
}

func (*levelLog) Reserve(*Message)                                 {}
func (*levelLog) Propose(_ *Message, _ AckMode, done Done)         { done.Done(errors.New("no log")) }
func (*levelLog) Logged(uint64, []uint64) (map[uint64]bool, error) { return nil, nil }
func (l *levelLog) PageCounts() bool                               { return l.level.Load() >= 3 }
func (l *levelLog) CapsApplied() bool                              { return l.level.Load() >= 2 }

// levelMember is one member's broker on its own session store, which a restart
// keeps.
type levelMember struct {
	t     *testing.T
	log   *levelLog
	store *memStore
	s     *Server
}

func (m *levelMember) start() {
	m.t.Helper()
	cfg := Config{Listen: "127.0.0.1:0", AllowAnonymous: true, Sessions: m.store, NodeID: 1}
	cfg.Limits.MaxRetainedBytes = 16 << 10
	cfg.Limits.MaxSessionBytes = 1 << 20
	s, err := NewServer(cfg, m.log)
	if err != nil {
		m.t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		m.t.Fatal(err)
	}
	if m.s == nil {
		m.t.Cleanup(func() { _ = m.s.Stop() })
	}
	m.s = s
}

func (m *levelMember) restart() {
	m.t.Helper()
	if err := m.s.Stop(); err != nil {
		m.t.Fatal(err)
	}
	m.start()
}

// retainedSet is topic → the index that set it, as the store holds it.
func (m *levelMember) retainedSet() map[string]uint64 {
	r := m.s.retained
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := map[string]uint64{}
	for t, e := range r.m {
		out[t] = e.index
	}
	return out
}

// From the log position where the cluster's feature level reaches 3 every
// member counts max_retained_bytes and max_session_bytes in pages, and
// before it in bytes, as the builds before it count (the cap at apply is
// a rule of the replicated state: members counting differently would
// retain different messages). Two members apply the same records, one of
// them restarted below the level and again right after the raise: they
// hold the same retained messages and count the same bytes at every step,
// the ones a build counting bytes holds below the level; a third that
// installs a snapshot after the raise counts as they do.
func TestRetainedCapCountsByTheFeatureLevelAlikeOnEveryMember(t *testing.T) {
	log := newLevelLog(2) // bytes
	a := &levelMember{t: t, log: log, store: newMemStore()}
	b := &levelMember{t: t, log: log, store: newMemStore()}
	a.start()
	b.start()
	var index uint64
	apply := func(m *Message) {
		index++
		m.Origin, m.Seq = 9, index // another member's records
		for _, mb := range []*levelMember{a, b} {
			c := *m
			mb.s.Retain(index, &c)
		}
	}
	payload := func(n int) []byte { return []byte(strings.Repeat("p", n)) }
	retain := func(topic string, n int) {
		apply(&Message{Topic: topic, ClientID: "dev", Payload: payload(n), Retain: true, QoS: 1})
	}
	session := func(id string, op sessionOp) {
		b, err := json.Marshal(op)
		if err != nil {
			t.Fatal(err)
		}
		apply(&Message{Kind: KindSession, Topic: sessionTopic, ClientID: id, Payload: b})
	}
	same := func(step string, pages bool, others ...*levelMember) map[string]uint64 {
		t.Helper()
		set := a.retainedSet()
		for _, o := range append([]*levelMember{b}, others...) {
			if got := o.retainedSet(); !maps.Equal(got, set) {
				t.Fatalf("%s: the members retain different messages: %d and %d topics", step, len(set), len(got))
			}
			if ra, ro := a.s.RetainedBytes(), o.s.RetainedBytes(); ra != ro {
				t.Fatalf("%s: retained bytes %d and %d", step, ra, ro)
			}
			if sa, so := a.s.SessionBytes(), o.s.SessionBytes(); sa != so {
				t.Fatalf("%s: session bytes %d and %d", step, sa, so)
			}
		}
		var want int64
		a.store.Load(keyRetained, func(k string, v []byte) error {
			var rec retainedRec
			if err := json.Unmarshal(v, &rec); err != nil {
				t.Fatal(err)
			}
			size, _ := retainedSizes(rec.M, pages)
			want += size
			return nil
		})
		if ra := a.s.RetainedBytes(); ra != want {
			t.Fatalf("%s: retained bytes %d, want %d (pages: %v)", step, ra, want, pages)
		}
		return set
	}

	// Level 2: 30 retained messages of 40 bytes count 319 bytes each
	// (1,068 in pages, of which the 16 KiB cap holds 15).
	session("dev-s", sessionOp{Op: "start", Expiry: 600})
	session("dev-s", sessionOp{Op: "sub", Filter: "t/#", QoS: 1})
	for i := range 15 {
		retain(fmt.Sprintf("t/%02d", i), 40)
	}
	b.restart()
	same("below level 3, b restarted", false)
	for i := 15; i < 30; i++ {
		retain(fmt.Sprintf("t/%02d", i), 40)
	}
	if set := same("below level 3", false); len(set) != 30 {
		t.Fatalf("below level 3: %d topics retained, want the 30 a build counting bytes retains", len(set))
	}
	if got, want := a.s.SessionBytes(), sessionRecCount("dev-s", "", false)+subRecCount("dev-s", "t/#", false); got != want {
		t.Fatalf("below level 3: session bytes %d, want %d (bytes)", got, want)
	}

	// c joins below level 3 with nothing, and installs a snapshot of a's
	// state taken after the raise: it counts by the snapshot's level.
	c := &levelMember{t: t, log: log, store: newMemStore()}
	c.start()

	// The raise: b restarts on the state and level of that position, a
	// recounts at its next record. Pages: 30 of 1,068 bytes pass the cap,
	// kept by both; a new topic is not retained, a replacement no larger
	// is.
	log.level.Store(3)
	b.restart()
	retain("t/new", 40)
	retain("t/00", 40)
	set := same("at the raise", true)
	if _, ok := set["t/new"]; ok || len(set) != 30 || set["t/00"] != index {
		t.Fatalf("at the raise: %d topics, t/new %v, t/00 at %d (want 30, not retained, %d)", len(set), set["t/new"], set["t/00"], index)
	}
	if got, want := a.s.SessionBytes(), sessionRecCount("dev-s", "", true)+subRecCount("dev-s", "t/#", true); got != want {
		t.Fatalf("at level 3: session bytes %d, want %d (pages)", got, want)
	}
	// Cleared down to 5, there is room for as many more as their pages
	// fit in, not one more.
	for i := 5; i < 30; i++ {
		apply(&Message{Topic: fmt.Sprintf("t/%02d", i), ClientID: "dev", Retain: true})
	}
	kept := 5 * retainedSize(&Message{Topic: "t/00", ClientID: "dev", Payload: payload(40)})
	room := int((16<<10 - kept) / retainedSize(&Message{Topic: "u/0", ClientID: "dev", Payload: payload(40)}))
	for i := range room + 1 {
		retain(fmt.Sprintf("u/%d", i), 40)
	}
	set = same("level 3", true)
	topics := make([]string, 0, len(set))
	for t := range set {
		topics = append(topics, t)
	}
	sort.Strings(topics)
	if len(set) != 5+room || set[fmt.Sprintf("u/%d", room-1)] == 0 {
		t.Fatalf("level 3: retained %v, want t/00-04 and u/0-%d", topics, room-1)
	}
	b.restart()
	same("level 3, b restarted", true)
	err := c.s.Restore(index, func() error {
		a.store.mu.Lock()
		defer a.store.mu.Unlock()
		c.store.mu.Lock()
		defer c.store.mu.Unlock()
		c.store.m = maps.Clone(a.store.m)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	same("level 3, a snapshot installed on c", true, c)
}

// Below feature level 2 a member may run v0.1.0, which has no caps on
// retained messages and retains every retained record it applies: the
// members of this build retain them too, past the caps (a v0.1.0 member
// admits any publish), or their retained messages would differ from its
// for good. Once the level is raised the caps apply again, to the same
// state on every member, a restarted one included.
func TestRetainedPastTheCapIsRetainedBelowLevel2AsV010Does(t *testing.T) {
	log := newLevelLog(1)
	a := &levelMember{t: t, log: log, store: newMemStore()}
	b := &levelMember{t: t, log: log, store: newMemStore()}
	a.start()
	b.start()
	var index uint64
	retain := func(topic string) {
		index++
		for _, mb := range []*levelMember{a, b} {
			mb.s.Retain(index, &Message{Topic: topic, ClientID: "dev", Payload: []byte(strings.Repeat("p", 40)), Retain: true, QoS: 1, Origin: 9, Seq: index})
		}
	}
	same := func(step string, want int) map[string]uint64 {
		t.Helper()
		set := a.retainedSet()
		if got := b.retainedSet(); !maps.Equal(got, set) || len(set) != want {
			t.Fatalf("%s: the members retain %d and %d topics, want %d", step, len(set), len(got), want)
		}
		if ra, rb := a.s.RetainedBytes(), b.s.RetainedBytes(); ra != rb {
			t.Fatalf("%s: retained bytes %d and %d", step, ra, rb)
		}
		return set
	}
	// 60 of 319 bytes: 19,140, past the 16 KiB cap.
	for i := range 30 {
		retain(fmt.Sprintf("t/%02d", i))
	}
	b.restart()
	for i := 30; i < 60; i++ {
		retain(fmt.Sprintf("t/%02d", i))
	}
	same("level 1", 60)
	if got := a.s.RetainedBytes(); got <= 16<<10 {
		t.Fatalf("level 1: %d retained bytes, want them past the cap", got)
	}
	// Raised to this release's level: over the cap on both, no new topic.
	log.level.Store(3)
	b.restart()
	retain("t/new")
	retain("t/00")
	if set := same("level 3", 60); set["t/00"] != index {
		t.Fatalf("level 3: t/00 at %d, want replaced at %d", set["t/00"], index)
	}
}
