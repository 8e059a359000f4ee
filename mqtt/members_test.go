package mqtt

import (
	"bytes"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// sharedLog is a replicated log in memory for several members, each a
// Server with its own node id, session store and applier: what a cluster
// looks like from mqtt/. A proposal commits at once, in order, on all.
type sharedLog struct {
	mu   sync.Mutex // guards recs and every member's applied, seq, cut, stopped
	cond *sync.Cond
	recs []*Message // recs[i] is index i+1
	// aborts are the aborted indexes of the settlement record at an
	// index (settle).
	aborts map[uint64][]uint64
}

func newSharedLog() *sharedLog {
	l := &sharedLog{}
	l.cond = sync.NewCond(&l.mu)
	return l
}

// add appends a copy of m, as if published on any member.
func (l *sharedLog) add(m *Message) {
	l.mu.Lock()
	c := *m
	c.Payload = bytes.Clone(m.Payload)
	l.recs = append(l.recs, &c)
	l.cond.Broadcast()
	l.mu.Unlock()
}

// settle logs a settlement, as memLog's: every sync record up to upto
// settled, those in aborts aborted; every member applies it.
func (l *sharedLog) settle(upto uint64, aborts ...uint64) {
	l.mu.Lock()
	appendSettle(&l.recs, &l.aborts, upto, aborts)
	l.cond.Broadcast()
	l.mu.Unlock()
}

// member is one gateway on a sharedLog: it implements Log and Retained.
type member struct {
	l       *sharedLog
	id      uint64
	seq     uint64
	applied uint64
	cut     bool // killed: its proposals are lost
	legacy  bool // writes control records as a cluster below feature level 2
	// level3: a cluster below feature level 4, where no "resend" record
	// is logged (ResendRules).
	level3  bool
	stopped bool
	// gate, when set, is asked about each proposal: it may hold it back
	// until wait is closed, and refuse it with err (then or at once).
	gate func(msg *Message) (wait <-chan struct{}, err error)
	// pause, when not 0, is the last index the applier applies until it
	// is cleared: a member behind the log (a follower that learns the
	// commit index from the next master).
	pause uint64
	srv   *Server
	store *memStore
	done  chan struct{}
}

var errCut = errors.New("member killed")

func (m *member) Reserve(msg *Message) {
	m.l.mu.Lock()
	m.seq++
	msg.Origin, msg.Seq = m.id, m.seq
	m.l.mu.Unlock()
}

func (m *member) Propose(msg *Message, mode AckMode, done Done) {
	m.l.mu.Lock()
	if gate := m.gate; gate != nil {
		if wait, err := gate(msg); wait != nil || err != nil {
			m.l.mu.Unlock()
			if wait == nil {
				done.Done(err)
				return
			}
			c := *msg
			c.Payload = bytes.Clone(msg.Payload) // msg is not ours after Propose returns
			go func() {
				<-wait
				if err != nil {
					done.Done(err)
					return
				}
				m.Propose(&c, mode, done)
			}()
			return
		}
	}
	if m.cut {
		m.l.mu.Unlock()
		done.Done(errCut)
		return
	}
	m.l.mu.Unlock()
	m.l.add(msg)
	done.Done(nil)
}

func (m *member) Logged(origin uint64, seqs []uint64) (map[uint64]bool, error) {
	m.l.mu.Lock()
	defer m.l.mu.Unlock()
	out := map[uint64]bool{}
	for _, r := range m.l.recs {
		for _, s := range seqs {
			if r.Origin == origin && r.Seq == s {
				out[s] = true
			}
		}
	}
	return out, nil
}

func (m *member) FirstIndex() uint64 { return 1 }

// LegacyControl implements ControlEncoding.
func (m *member) LegacyControl() bool { return m.legacy }

// OtherMembers implements Clustered: a sharedLog has several members.
func (m *member) OtherMembers() bool { return true }

func (m *member) InboundResends() bool { return !m.level3 && !m.legacy }

func (m *member) Committed(from, to uint64, fn func(uint64, *Message) bool) error {
	m.l.mu.Lock()
	var batch []*Message
	for i := from; i <= to && int(i) <= len(m.l.recs); i++ {
		batch = append(batch, m.l.recs[i-1])
	}
	m.l.mu.Unlock()
	for i, r := range batch {
		c := *r
		if !fn(from+uint64(i), &c) {
			break
		}
	}
	return nil
}

// apply hands every record to the member's server, in log order, until
// stopped.
func (m *member) apply() {
	defer close(m.done)
	for {
		m.l.mu.Lock()
		for !m.stopped && (int(m.applied) >= len(m.l.recs) || (m.pause > 0 && m.applied >= m.pause)) {
			m.l.cond.Wait()
		}
		if m.stopped {
			m.l.mu.Unlock()
			return
		}
		idx := m.applied + 1
		r := *m.l.recs[idx-1]
		aborts := m.l.aborts[idx]
		m.l.mu.Unlock()
		if r.Topic == testSettleTopic {
			m.srv.Settle(idx, r.Seq, aborts, 0, false)
		} else if err := m.srv.Deliver(idx, &r); err != nil {
			panic(err)
		}
		m.l.mu.Lock()
		m.applied = idx
		m.l.cond.Broadcast()
		m.l.mu.Unlock()
	}
}

// holdReleases holds the member's release records (session records
// "rel") back from the log until the returned func is called (at cleanup
// at the latest): a release the other members have not got yet.
func (m *member) holdReleases(t *testing.T) (let func()) {
	hold := make(chan struct{})
	m.setGate(func(msg *Message) (<-chan struct{}, error) {
		if isSessionOp(msg, "rel") {
			return hold, nil
		}
		return nil, nil
	})
	var once sync.Once
	let = func() {
		once.Do(func() {
			m.setGate(nil)
			close(hold)
		})
	}
	t.Cleanup(let)
	return let
}

// setGate sets (nil: clears) the member's gate on proposals.
func (m *member) setGate(gate func(*Message) (<-chan struct{}, error)) {
	m.l.mu.Lock()
	m.gate = gate
	m.l.mu.Unlock()
}

// isSessionOp reports whether msg is a session record of op.
func isSessionOp(msg *Message, op string) bool {
	return msg.Kind == KindSession && bytes.Contains(msg.Payload, []byte(`"op":"`+op+`"`))
}

// holdHere stops the member's applier after what the log holds now, and
// returns that index: the member applies nothing logged from here on.
func (m *member) holdHere() uint64 {
	m.l.mu.Lock()
	last := uint64(len(m.l.recs))
	m.l.mu.Unlock()
	m.holdAt(last)
	return last
}

// offline says whether the member holds the session id, offline.
func (m *member) offline(id string) func() bool {
	return func() bool {
		m.srv.mu.Lock()
		se := m.srv.sessions[id]
		m.srv.mu.Unlock()
		return se != nil && !se.online()
	}
}

// holdAt stops the member's applier after index (0: it goes on).
func (m *member) holdAt(index uint64) {
	m.l.mu.Lock()
	m.pause = index
	m.l.cond.Broadcast()
	m.l.mu.Unlock()
}

// caughtUp waits until the member has applied the whole log.
func (m *member) caughtUp(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	m.l.mu.Lock()
	defer m.l.mu.Unlock()
	for int(m.applied) < len(m.l.recs) {
		if time.Now().After(deadline) {
			t.Fatalf("member %d applied %d of %d records", m.id, m.applied, len(m.l.recs))
		}
		m.l.mu.Unlock()
		time.Sleep(2 * time.Millisecond)
		m.l.mu.Lock()
	}
}

// caughtUpTo waits until the member has applied index.
func (m *member) caughtUpTo(t *testing.T, index uint64) {
	t.Helper()
	testutil.WaitFor(t, 5*time.Second, "the member applies up to the index", func() bool {
		m.l.mu.Lock()
		defer m.l.mu.Unlock()
		return m.applied >= index
	})
}

// kill ends the member as kill -9 would: nothing it proposes from now on
// reaches the log, and its server and applier stop.
func (m *member) kill(t *testing.T) {
	t.Helper()
	m.l.mu.Lock()
	m.cut = true
	m.l.mu.Unlock()
	m.halt(t)
}

// halt stops the member's server (within 5 s, or the test fails) and its
// applier; once only.
func (m *member) halt(t *testing.T) {
	m.l.mu.Lock()
	if m.stopped {
		m.l.mu.Unlock()
		return
	}
	m.l.mu.Unlock()
	stopped := make(chan struct{})
	go func() {
		_ = m.srv.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Errorf("member %d did not stop within 5 s", m.id)
	}
	m.l.mu.Lock()
	m.stopped = true
	m.l.cond.Broadcast()
	m.l.mu.Unlock()
	<-m.done
}

// startMember starts a member with node id on l, stopped at cleanup.
func startMember(t *testing.T, l *sharedLog, id uint64) *member {
	t.Helper()
	return startMemberWith(t, &member{l: l, id: id, store: newMemStore()}, nil)
}

// startMemberWith starts m (its log, id, store, applied index and
// legacy set), tune changing its config first.
func startMemberWith(t *testing.T, m *member, tune func(*Config)) *member {
	t.Helper()
	m.done = make(chan struct{})
	cfg := Config{Listen: "127.0.0.1:0", AllowAnonymous: true, Sessions: m.store, NodeID: m.id}
	cfg.Limits.ConnectRate = -1
	if tune != nil {
		tune(&cfg)
	}
	s, err := NewServer(cfg, m)
	if err != nil {
		t.Fatal(err)
	}
	m.srv = s
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	go m.apply()
	t.Cleanup(func() { m.halt(t) })
	return m
}
