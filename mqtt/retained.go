package mqtt

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"sync"
	"weak"
)

// The retained store (DESIGN.md, "Budgets: what one device may take").
//
// Retained messages are state, not log: retention cannot drop them, so
// they are capped, by topics (Limits.MaxRetained) and by bytes
// (Limits.MaxRetainedBytes). A retained publish that would pass a cap is
// refused on the member that takes it, before it is logged (PUBACK 0x97),
// so its publisher knows. Publishes racing on several members, or a will,
// may still bring the log a record past a cap: at apply every member
// applies the same rule to the same committed state, and such a record is
// delivered as a plain message, not retained, everywhere alike. The rule
// follows the cluster's feature level (counts.go): none below level 2,
// bytes below 3, pages from 3 on.
//
// Only what routing needs is held in memory: the topic, the size and the
// index of each, and the payload of the small ones. A large payload is
// read from the session store when a subscription asks for it; the copy
// read is kept through a weak pointer, so subscribers served at the same
// moment share one copy and none is held once they are done.

// retainedInline is the largest payload kept in memory; larger ones are
// read from the session store when delivered.
const retainedInline = 1 << 10

// retainedJSON bounds the JSON of a retainedRec beyond its strings and
// payload: the field names (Go's, the struct has no tags), the largest
// numbers, the quotes and commas (403 bytes with every string empty and
// every number at its widest).
const retainedJSON = 408

// retainedSize is what a retained message counts against
// max_retained_bytes from feature level 3 on (counts.go): the bytes bbolt
// gives its record in the data file, pages included (storedSize). It reads only fields the record carries,
// so every member finds the same size for the same record.
func retainedSize(m *Message) int64 {
	b64 := base64.StdEncoding.EncodedLen
	n := retainedJSON + jsonLen(m.Topic) + jsonLen(m.ClientID) + b64(len(m.Payload)) +
		jsonLen(m.ContentType) + jsonLen(m.ResponseTopic) + b64(len(m.CorrelationData))
	for _, u := range m.User {
		n += jsonLen(u.Key) + jsonLen(u.Val) + len(`{"k":"","v":""},`)
	}
	return storedSize(len(keyRetained)+len(m.Topic), n)
}

// retainStore holds the retained messages, by topic.
type retainStore struct {
	// mu guards m, bytes, pendNew and pendBytes, and the entries' cache.
	// Only the applier changes m (and Start, Restore before it serves).
	mu    sync.RWMutex
	m     map[string]*retained
	bytes int64 // the sizes of m, summed
	// pendNew and pendBytes are what publishes taken here and not yet
	// applied were admitted for: new topics and bytes. pend has their
	// reservations by record sequence number, given back when the
	// record is applied (or the log refuses it): until then the record
	// is in neither m nor the log's past, and a publish racing it must
	// count it.
	pendNew   int
	pendBytes int64
	pend      map[uint64]*reservation
	// pendTopics holds, per topic not yet in m, how many reservations
	// add it and the size the latest was admitted at: a second publish to
	// it before the first is applied replaces that one, and adds no topic.
	pendTopics map[string]*pendTopic

	// pages is the rule the entries' sizes count by (counts.go).
	// Guarded by mu; only the applier changes it (countBy).
	pages bool

	maxCount int
	maxBytes int64
	store    SessionStore // nil: every payload is kept in memory
	mem      *memAccount  // charged what the store holds in memory
}

type retained struct {
	index uint64
	// size is what the entry counts by the store's rule, other by the
	// other rule (retainedSizes): a change of rule swaps them.
	size, other int64
	m           *Message // nil when the payload is read from the store
	// cache is the copy last read from the store, while a delivery
	// holds it.
	cache weak.Pointer[Message]
}

// held is what an entry keeps in memory, for the memory account.
func (e *retained) held(topic string) int64 {
	n := int64(len(topic) + 64)
	if e.m != nil {
		n += int64(len(e.m.Payload) + len(e.m.ClientID))
	}
	return n
}

func newRetainStore(l *Limits, store SessionStore, mem *memAccount) *retainStore {
	return &retainStore{m: map[string]*retained{}, maxCount: l.MaxRetained, maxBytes: l.MaxRetainedBytes, store: store, mem: mem}
}

func (r *retainStore) len() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return len(r.m)
}

func (r *retainStore) size() int64 {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.bytes
}

// sizeOf is what m counts by the store's rule now.
func (r *retainStore) sizeOf(m *Message) int64 {
	r.mu.RLock()
	pages := r.pages
	r.mu.RUnlock()
	size, _ := retainedSizes(m, pages)
	return size
}

// countBy makes the entries count by the rule pages says, and returns
// their sum. The reservations of publishes not yet applied keep what they
// were admitted for: they are given back as their records apply.
func (r *retainStore) countBy(pages bool) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pages != pages {
		r.pages = pages
		r.bytes = 0
		for _, e := range r.m {
			e.size, e.other = e.other, e.size
			r.bytes += e.size
		}
	}
	return r.bytes
}

// Reasons a retained publish is refused, as logged and counted.
const (
	whyRetainedCount = "retained topics at max_retained: retained publish refused"
	whyRetainedBytes = "retained bytes at max_retained_bytes: retained publish refused"
	whyRetainedApply = "retained message past max_retained or max_retained_bytes at apply: delivered, not retained"
)

// reservation is what a retained publish taken here was admitted for,
// until its record is applied.
type pendTopic struct {
	n    int
	size int64
}

type reservation struct {
	r         *retainStore
	topic     string
	pendTopic bool // counted in pendTopics
	newTopics int
	grow      int64
	seq       uint64 // the record's, once tracked
	done      bool   // guarded by r.mu
}

// reserve admits a retained publish of size bytes on topic taken here,
// before it is logged, counting what earlier ones not yet applied were
// admitted for. why is the refusal's reason, "" when admitted; a nil
// reservation with no reason means there is nothing to hold (clearing a
// topic, an empty payload, is always taken). Replacing a topic's message
// is admitted whenever the bytes stay within the cap.
func (r *retainStore) reserve(topic string, size int64, empty bool) (res *reservation, why string) {
	if empty {
		return nil, ""
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	res = &reservation{r: r, topic: topic, grow: size}
	switch old := r.m[topic]; {
	case old != nil:
		res.grow = max(0, size-old.size)
	case r.pendTopics[topic] != nil:
		// Added by a publish not applied yet: this one replaces it.
		res.grow = max(0, size-r.pendTopics[topic].size)
	default:
		res.newTopics = 1
		if len(r.m)+r.pendNew+1 > r.maxCount {
			return nil, whyRetainedCount
		}
	}
	if r.bytes+r.pendBytes+res.grow > r.maxBytes {
		return nil, whyRetainedBytes
	}
	r.pendNew += res.newTopics
	r.pendBytes += res.grow
	if r.m[topic] == nil {
		if r.pendTopics == nil {
			r.pendTopics = map[string]*pendTopic{}
		}
		pt := r.pendTopics[topic]
		if pt == nil {
			pt = &pendTopic{}
			r.pendTopics[topic] = pt
		}
		pt.n++
		pt.size = max(pt.size, size)
		res.pendTopic = true
	}
	return res, ""
}

// track notes the sequence number of the record res was made for, whose
// apply gives it back (applied).
func (res *reservation) track(seq uint64) {
	r := res.r
	r.mu.Lock()
	defer r.mu.Unlock()
	if res.done {
		return
	}
	if r.pend == nil {
		r.pend = map[uint64]*reservation{}
	}
	res.seq = seq
	r.pend[seq] = res
}

// release gives res back: its record was applied, or will never be.
func (res *reservation) release() {
	r := res.r
	r.mu.Lock()
	defer r.mu.Unlock()
	res.releaseLocked()
}

func (res *reservation) releaseLocked() {
	if res.done {
		return
	}
	res.done = true
	r := res.r
	r.pendNew -= res.newTopics
	r.pendBytes -= res.grow
	if pt := r.pendTopics[res.topic]; res.pendTopic && pt != nil {
		if pt.n--; pt.n <= 0 {
			delete(r.pendTopics, res.topic)
		}
	}
	if r.pend[res.seq] == res {
		delete(r.pend, res.seq)
	}
}

// applied gives back the reservation of the record seq of this member,
// which the applier has now applied.
func (r *retainStore) applied(seq uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if res := r.pend[seq]; res != nil {
		res.releaseLocked()
	}
}

// dropPending forgets every reservation: the log was replaced, and the
// records they wait for may never be applied.
func (r *retainStore) dropPending() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, res := range r.pend {
		res.releaseLocked()
	}
}

// fits is the rule at apply: whether a committed record setting topic to
// m stays within the caps, counting the committed state only, by the rule
// of its log position, the same on every member.
func (r *retainStore) fits(topic string, m *Message) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	size, _ := retainedSizes(m, r.pages)
	old := r.m[topic]
	if old == nil {
		return len(r.m) < r.maxCount && r.bytes+size <= r.maxBytes
	}
	return size <= old.size || r.bytes-old.size+size <= r.maxBytes
}

// set makes m topic's retained message, without looking at the caps.
func (r *retainStore) set(topic string, index uint64, m *Message) {
	e := &retained{index: index, m: m}
	if r.store != nil && len(m.Payload) > retainedInline {
		e.m = nil
	}
	pages, bytes := retainedSize(m), retainedBytes(m)
	r.mu.Lock()
	e.size, e.other = bytes, pages
	if r.pages {
		e.size, e.other = pages, bytes
	}
	old := r.m[topic]
	r.m[topic] = e
	r.bytes += e.size
	if old != nil {
		r.bytes -= old.size
	}
	r.mu.Unlock()
	r.mem.charge(e.held(topic))
	if old != nil {
		r.mem.release(old.held(topic))
	}
}

// remove drops topic's retained message.
func (r *retainStore) remove(topic string) {
	r.mu.Lock()
	old := r.m[topic]
	if old != nil {
		delete(r.m, topic)
		r.bytes -= old.size
	}
	r.mu.Unlock()
	if old != nil {
		r.mem.release(old.held(topic))
	}
}

// removeIf drops the retained messages gone reports, and returns their
// topics.
func (r *retainStore) removeIf(gone func(e *retained) bool) []string {
	var topics []string
	var held int64
	r.mu.Lock()
	for t, e := range r.m {
		if gone(e) {
			topics = append(topics, t)
			delete(r.m, t)
			r.bytes -= e.size
			held += e.held(t)
		}
	}
	r.mu.Unlock()
	r.mem.release(held)
	return topics
}

// index returns the log index that set topic's retained message, and
// whether it has one.
func (r *retainStore) index(topic string) (uint64, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	e := r.m[topic]
	if e == nil {
		return 0, false
	}
	return e.index, true
}

// matching returns the retained messages whose topic matches filter, in
// the order they were set, their messages read from the store where
// memory holds none. A message replaced or cleared meanwhile is returned
// as the store has it now, or not at all.
func (r *retainStore) matching(filter string) []*retained {
	type found struct {
		topic string
		e     *retained
	}
	var fs []found
	r.mu.RLock()
	for t, e := range r.m {
		if MatchTopic(filter, t) {
			fs = append(fs, found{t, e})
		}
	}
	r.mu.RUnlock()
	out := make([]*retained, 0, len(fs))
	for _, f := range fs {
		if f.e.m != nil {
			out = append(out, f.e)
			continue
		}
		r.mu.RLock()
		m := f.e.cache.Value()
		r.mu.RUnlock()
		index := f.e.index
		if m == nil {
			rec, err := r.read(f.topic)
			if err != nil || rec == nil {
				continue // cleared meanwhile, or unreadable (read logs it)
			}
			m, index = rec.M, rec.Index
			r.mu.Lock()
			if r.m[f.topic] == f.e && f.e.index == index {
				f.e.cache = weak.Make(m)
			}
			r.mu.Unlock()
		}
		out = append(out, &retained{index: index, size: f.e.size, other: f.e.other, m: m})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].index < out[j].index })
	return out
}

// read reads topic's retained record from the store; nil when it has
// none.
func (r *retainStore) read(topic string) (*retainedRec, error) {
	key := keyRetained + topic
	var rec *retainedRec
	// The key itself comes first among those it prefixes.
	err := r.store.Load(key, func(k string, v []byte) error {
		if k == key {
			var got retainedRec
			if err := json.Unmarshal(v, &got); err != nil || got.M == nil {
				return fmt.Errorf("retained message %q: bad record", topic)
			}
			rec = &got
		}
		return errStopLoad
	})
	if err != nil && !errors.Is(err, errStopLoad) {
		return nil, err
	}
	return rec, nil
}

// reset empties the store: a snapshot replaces it.
func (r *retainStore) reset() {
	r.removeIf(func(*retained) bool { return true })
}

// retain applies a retained record: an empty payload clears the topic
// [MQTT-3.3.1-10]. The store on disk moves with the applied index. A
// record past the caps is not retained (the rule at apply, the same on
// every member; none below feature level 2, counts.go); retain reports
// whether the record was.
func (s *Server) retain(index uint64, m *Message) bool {
	key := keyRetained + m.Topic
	if len(m.Payload) == 0 {
		s.retained.remove(m.Topic)
		s.stageDelete(key)
		return true
	}
	s.followCounts()
	if s.capsApplied.Load() && !s.retained.fits(m.Topic, m) {
		s.refusal(m.ClientID, whyRetainedApply, "client", m.ClientID, "topic", truncate(m.Topic), "index", index)
		return false
	}
	// Staged before the entry is set: a delivery that finds the entry
	// without its payload reads it from the store.
	s.stageJSON(key, retainedRec{Index: index, M: m})
	s.retained.set(m.Topic, index, m)
	return true
}

// RetainedBytes is what the retained messages count against
// max_retained_bytes, for metrics.
func (s *Server) RetainedBytes() int64 { return s.retained.size() }
