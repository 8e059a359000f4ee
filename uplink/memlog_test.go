package uplink

import (
	"context"
	"sync"
	"time"
)

// memLog is an in-memory committed log that notifies its uplinks the way
// the daemon's applier will.
type memLog struct {
	order sync.Mutex // held through add: notifications in log order, as the applier's
	mu    sync.Mutex
	recs  []Record // recs[i].Index == first+i
	first uint64
	seq   map[string]uint64
	subs  []*Uplink
}

func newMemLog() *memLog { return &memLog{first: 1, seq: map[string]uint64{}} }

// add commits a record from client on topic and notifies the uplinks.
func (l *memLog) add(client, topic, payload string) Record {
	l.order.Lock()
	defer l.order.Unlock()
	l.mu.Lock()
	l.seq[client]++
	r := Record{
		Index:    l.first + uint64(len(l.recs)),
		Origin:   0xabc,
		Seq:      uint64(len(l.recs) + 1),
		ClientID: client,
		Topic:    topic,
		QoS:      1,
		Time:     time.Now().UnixNano(),
		Payload:  []byte(payload),
		Props:    Properties{User: []UserProperty{{Key: "k", Value: "v"}}},
		Size:     64 + len(topic) + len(payload),
	}
	l.recs = append(l.recs, r)
	subs := append([]*Uplink(nil), l.subs...)
	l.mu.Unlock()
	for _, u := range subs {
		u.Notify(r.Index, r.Topic, r.Size)
	}
	return r
}

func (l *memLog) attach(u *Uplink) {
	l.mu.Lock()
	l.subs = append(l.subs, u)
	l.mu.Unlock()
}

func (l *memLog) last() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.first + uint64(len(l.recs)) - 1
}

func (l *memLog) get(i uint64) Record {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.recs[i-l.first]
}

func (l *memLog) Committed(from, to uint64, fn func(r *Record) bool) error {
	l.mu.Lock()
	if from < l.first {
		from = l.first
	}
	var out []Record
	for i := from; i <= to && i-l.first < uint64(len(l.recs)); i++ {
		out = append(out, l.recs[i-l.first])
	}
	l.mu.Unlock()
	for i := range out {
		r := out[i]
		if !fn(&r) {
			break
		}
	}
	return nil
}

func (l *memLog) FirstIndex() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.first
}

// sink records saved positions.
type sink struct {
	mu    sync.Mutex
	saves []uint64
}

func (s *sink) Save(name string, index uint64) {
	s.mu.Lock()
	s.saves = append(s.saves, index)
	s.mu.Unlock()
}

func (s *sink) all() []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]uint64(nil), s.saves...)
}

func (s *sink) lastSaved() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.saves) == 0 {
		return 0
	}
	return s.saves[len(s.saves)-1]
}

// localPub is a LocalPublisher whose answer the test decides per call.
type localPub struct {
	mu     sync.Mutex
	calls  []Message
	answer func(ctx context.Context, n int, m *Message) error // n counts from 1
}

func (p *localPub) Publish(ctx context.Context, m *Message) error {
	p.mu.Lock()
	p.calls = append(p.calls, *m)
	n := len(p.calls)
	p.mu.Unlock()
	if p.answer == nil {
		return nil
	}
	return p.answer(ctx, n, m)
}

func (p *localPub) all() []Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Message(nil), p.calls...)
}

// dropFront drops the n oldest records, as retention does.
func (l *memLog) dropFront(n int) {
	l.mu.Lock()
	l.recs = l.recs[n:]
	l.first += uint64(n)
	l.mu.Unlock()
}
