package mqtt

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/mochi-mqtt/server/v2/packets"
)

// memLog is a Log in memory: a proposal commits at once, in order, and an
// applier goroutine hands each record to the server as the daemon's
// applier does. It is also the LogReader sessions replay from.
type memLog struct {
	mu      sync.Mutex // guards recs, seq, applied, sessions, hold
	recs    []*Message // recs[i] is index i+1
	seq     uint64
	applied uint64
	cond    *sync.Cond
	srv     *Server
	stopped bool
	// refuse, when set, is the error every proposal on a matching topic
	// resolves with.
	refuse func(topic string) error
	// halt stops the server running on the log and its applier.
	halt func()
	// first is the oldest index kept (retention), 0 for all.
	first uint64
	// hold, when set, delays every proposal until it is closed.
	hold chan struct{}
	// store is the session store.
	store *memStore
	// aborts are the aborted indexes of the settlement record at an index.
	aborts map[uint64][]uint64
	// scanHook, when set, is called after a scan has handed over index.
	scanHook func(index uint64)
}

func newMemLog() *memLog {
	l := &memLog{store: newMemStore()}
	l.cond = sync.NewCond(&l.mu)
	return l
}

func (l *memLog) Reserve(m *Message) {
	l.mu.Lock()
	l.seq++
	m.Origin, m.Seq = 1, l.seq
	l.mu.Unlock()
}

func (l *memLog) Propose(m *Message, mode AckMode, done Done) {
	if l.hold != nil {
		c := *m
		c.Payload = bytes.Clone(m.Payload) // m is not ours after Propose returns
		go func() {
			<-l.hold
			l.propose(&c, mode, done)
		}()
		return
	}
	l.propose(m, mode, done)
}

func (l *memLog) propose(m *Message, mode AckMode, done Done) {
	l.mu.Lock()
	if l.refuse != nil {
		if err := l.refuse(m.Topic); err != nil {
			l.mu.Unlock()
			done.Done(err)
			return
		}
	}
	c := *m
	c.Payload = bytes.Clone(m.Payload)
	c.Sync = mode == Sync // as the daemon flags the record
	l.recs = append(l.recs, &c)
	l.cond.Broadcast()
	l.mu.Unlock()
	done.Done(nil)
}

func (l *memLog) Logged(origin uint64, seqs []uint64) (map[uint64]bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[uint64]bool{}
	for _, m := range l.recs {
		for _, s := range seqs {
			if m.Origin == origin && m.Seq == s {
				out[s] = true
			}
		}
	}
	return out, nil
}

// FirstIndex implements Retained.
func (l *memLog) FirstIndex() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return max(l.first, 1)
}

func (l *memLog) Committed(from, to uint64, fn func(uint64, *Message) bool) error {
	// One record at a time, from the first index kept then: like the
	// store's chunked reads, a scan goes on past what retention drops
	// under it.
	for i := from; ; i++ {
		l.mu.Lock()
		i = max(i, l.first)
		if i > to || int(i) > len(l.recs) {
			l.mu.Unlock()
			return nil
		}
		c := *l.recs[i-1]
		hook := l.scanHook
		l.mu.Unlock()
		if !fn(i, &c) {
			return nil
		}
		if hook != nil {
			hook(i)
		}
	}
}

// apply runs the applier until stop.
func (l *memLog) apply() {
	for {
		l.mu.Lock()
		for !l.stopped && int(l.applied) >= len(l.recs) {
			l.cond.Wait()
		}
		if l.stopped {
			l.mu.Unlock()
			return
		}
		idx := l.applied + 1
		m := *l.recs[idx-1]
		aborts := l.aborts[idx]
		l.mu.Unlock()
		if m.Topic == testSettleTopic {
			l.srv.Settle(idx, m.Seq, aborts, 0, false)
		} else if m.Kind == KindMessage && l.srv.Unrouted([]byte(m.Topic)) && !m.Retain {
			l.srv.Applied(idx)
		} else if err := l.srv.Deliver(idx, &m); err != nil {
			panic(err)
		}
		l.mu.Lock()
		l.applied = idx
		l.mu.Unlock()
	}
}

// testSettleTopic is memLog's settlement record: the master's, as the
// daemon applies it (Seq carries upto, settleAborts the aborted indexes).
const testSettleTopic = "$tandem/test-settle"

// settle logs a settlement: every sync record up to upto settled, those
// in aborts aborted.
func (l *memLog) settle(upto uint64, aborts ...uint64) {
	l.mu.Lock()
	appendSettle(&l.recs, &l.aborts, upto, aborts)
	l.cond.Broadcast()
	l.mu.Unlock()
}

// appendSettle appends a settlement record to recs, its aborted indexes
// noted in byIndex under its index: memLog's and sharedLog's settle.
func appendSettle(recs *[]*Message, byIndex *map[uint64][]uint64, upto uint64, aborts []uint64) {
	*recs = append(*recs, &Message{Topic: testSettleTopic, Seq: upto})
	if *byIndex == nil {
		*byIndex = map[uint64][]uint64{}
	}
	(*byIndex)[uint64(len(*recs))] = aborts
}

// addRaw appends m, as it is, to the log: a record another member took.
func (l *memLog) addRaw(m *Message) {
	l.mu.Lock()
	l.recs = append(l.recs, m)
	l.cond.Broadcast()
	l.mu.Unlock()
}

// lastIndex is the index of the newest record.
func (l *memLog) lastIndex() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return uint64(len(l.recs))
}

func (l *memLog) topics() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, m := range l.recs {
		out = append(out, m.Topic)
	}
	return out
}

// memStore is a SessionStore in memory.
type memStore struct {
	mu sync.Mutex // guards m
	m  map[string][]byte
	// onSync, when set, runs in Sync: a test stretches the moment a
	// connect waits for it.
	onSync func()
}

func newMemStore() *memStore { return &memStore{m: map[string][]byte{}} }

func (s *memStore) Put(k string, v []byte) {
	s.mu.Lock()
	s.m[k] = bytes.Clone(v)
	s.mu.Unlock()
}

func (s *memStore) Delete(k string) {
	s.mu.Lock()
	delete(s.m, k)
	s.mu.Unlock()
}

func (s *memStore) Sync() error {
	if s.onSync != nil {
		s.onSync()
	}
	return nil
}

func (s *memStore) Load(prefix string, fn func(string, []byte) error) error {
	s.mu.Lock()
	var keys []string
	for k := range s.m {
		if strings.HasPrefix(k, prefix) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	vals := make([][]byte, len(keys))
	for i, k := range keys {
		vals[i] = s.m[k]
	}
	s.mu.Unlock()
	for i, k := range keys {
		if err := fn(k, vals[i]); err != nil {
			return err
		}
	}
	return nil
}

// testServer starts a Server on loopback over log (a new memLog when
// nil), stopped at cleanup: and checks there that it stops within 5 s.
func testServer(t testing.TB, log *memLog, mutate func(*Config)) (*Server, *memLog) {
	t.Helper()
	if log == nil {
		log = newMemLog()
	}
	cfg := Config{Listen: "127.0.0.1:0", AllowAnonymous: true, Sessions: log.store, NodeID: 1} // memLog gives records origin 1
	cfg.Limits.ConnectRate = -1
	if mutate != nil {
		mutate(&cfg)
	}
	s, err := NewServer(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	log.mu.Lock()
	log.srv, log.stopped = s, false
	log.mu.Unlock()
	s.Applied(uint64(len(log.recs)))
	log.applied = uint64(len(log.recs))
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		log.apply()
		close(done)
	}()
	var once sync.Once
	log.halt = func() { once.Do(func() { stopServer(t, s, log, done) }) }
	t.Cleanup(log.halt)
	return s, log
}

// stopServer stops s (once) and fails the test if that takes over 5 s.
func stopServer(t testing.TB, s *Server, log *memLog, applier chan struct{}) {
	stopped := make(chan struct{})
	go func() {
		_ = s.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Error("the server did not stop within 5 s")
	}
	log.mu.Lock()
	log.stopped = true
	log.cond.Broadcast()
	log.mu.Unlock()
	<-applier
}

// raw is a client speaking raw frames.
type raw struct {
	t  *testing.T
	c  net.Conn
	v  byte
	rd *bytesReader
}

type bytesReader struct{ r io.Reader }

func dialRaw(t *testing.T, addr string, v byte) *raw {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &raw{t: t, c: c, v: v, rd: &bytesReader{c}}
}

// write encodes pk for the raw client's version and sends it.
func (r *raw) write(pk packets.Packet) {
	r.t.Helper()
	pk.ProtocolVersion = r.v
	var b bytes.Buffer
	var err error
	switch pk.FixedHeader.Type {
	case packets.Connect:
		err = pk.ConnectEncode(&b)
	case packets.Publish:
		err = pk.PublishEncode(&b)
	case packets.Puback:
		err = pk.PubackEncode(&b)
	case packets.Pubrec:
		err = pk.PubrecEncode(&b)
	case packets.Pubrel:
		err = pk.PubrelEncode(&b)
	case packets.Pubcomp:
		err = pk.PubcompEncode(&b)
	case packets.Subscribe:
		err = pk.SubscribeEncode(&b)
	case packets.Unsubscribe:
		err = pk.UnsubscribeEncode(&b)
	case packets.Pingreq:
		err = pk.PingreqEncode(&b)
	case packets.Disconnect:
		err = pk.DisconnectEncode(&b)
	}
	if err != nil {
		r.t.Fatal(err)
	}
	r.send(b.Bytes())
}

func (r *raw) send(b []byte) {
	r.t.Helper()
	if _, err := r.c.Write(b); err != nil {
		r.t.Fatalf("write: %v", err)
	}
}

// connect sends CONNECT and returns the CONNACK.
func (r *raw) connect(id string, clean bool, props *packets.Properties) packets.Packet {
	r.t.Helper()
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: id, Clean: clean, Keepalive: 30}}
	if props != nil {
		pk.Properties = *props
	}
	r.write(pk)
	ack, err := r.read(5 * time.Second)
	if err != nil || ack.FixedHeader.Type != packets.Connack {
		r.t.Fatalf("no CONNACK: %v %+v", err, ack.FixedHeader)
	}
	return ack
}

// read reads the next packet within d.
func (r *raw) read(d time.Duration) (packets.Packet, error) {
	var pk packets.Packet
	_ = r.c.SetReadDeadline(time.Now().Add(d))
	var hb [1]byte
	if _, err := io.ReadFull(r.c, hb[:]); err != nil {
		return pk, err
	}
	if err := pk.FixedHeader.Decode(hb[0]); err != nil {
		return pk, err
	}
	n, _, err := packets.DecodeLength(byteReader{r.c})
	if err != nil {
		return pk, err
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r.c, buf); err != nil {
		return pk, err
	}
	pk.FixedHeader.Remaining = n
	pk.ProtocolVersion = r.v
	switch pk.FixedHeader.Type {
	case packets.Connack:
		err = pk.ConnackDecode(buf)
	case packets.Publish:
		err = pk.PublishDecode(buf)
	case packets.Puback:
		err = pk.PubackDecode(buf)
	case packets.Pubrec:
		err = pk.PubrecDecode(buf)
	case packets.Pubrel:
		err = pk.PubrelDecode(buf)
	case packets.Pubcomp:
		err = pk.PubcompDecode(buf)
	case packets.Suback:
		err = pk.SubackDecode(buf)
	case packets.Unsuback:
		err = pk.UnsubackDecode(buf)
	case packets.Disconnect:
		err = pk.DisconnectDecode(buf)
	}
	return pk, err
}

// next reads the next packet or fails the test.
func (r *raw) next() packets.Packet {
	r.t.Helper()
	pk, err := r.read(5 * time.Second)
	if err != nil {
		r.t.Fatalf("reading: %v", err)
	}
	return pk
}

// expect reads the next packet and checks its type.
func (r *raw) expect(typ byte) packets.Packet {
	r.t.Helper()
	pk := r.next()
	if pk.FixedHeader.Type != typ {
		r.t.Fatalf("got packet type %d (reason %#x), want %d", pk.FixedHeader.Type, pk.ReasonCode, typ)
	}
	return pk
}

// closed reads until the server closes the connection; it returns the
// DISCONNECT reason if one came first (0 when none).
func (r *raw) closed() (reason byte, sawDisconnect bool) {
	r.t.Helper()
	d, ok := r.closedBy()
	return d.ReasonCode, ok
}

// closedBy reads until the server closes the connection; it returns the
// DISCONNECT that came first, if one did.
func (r *raw) closedBy() (disconnect packets.Packet, ok bool) {
	r.t.Helper()
	for {
		pk, err := r.read(5 * time.Second)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				r.t.Fatal("the connection was not closed")
			}
			return disconnect, ok
		}
		if pk.FixedHeader.Type == packets.Disconnect {
			disconnect, ok = pk, true
		}
	}
}

func (r *raw) subscribe(pid uint16, filters ...packets.Subscription) packets.Packet {
	r.t.Helper()
	r.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: pid, Filters: filters})
	return r.expect(packets.Suback)
}

func (r *raw) publish(topic string, qos byte, pid uint16, payload string) {
	r.t.Helper()
	r.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos}, TopicName: topic, PacketID: pid, Payload: []byte(payload)})
}

type byteReader struct{ r io.Reader }

func (b byteReader) ReadByte() (byte, error) {
	var x [1]byte
	_, err := io.ReadFull(b.r, x[:])
	return x[0], err
}

// pahoClient connects a paho.golang MQTT 5 client; received publishes go
// to the channel.
func pahoClient(t *testing.T, addr, id string, cp *paho.Connect) (*paho.Client, chan *paho.Publish) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *paho.Publish, 4096)
	c := paho.NewClient(paho.ClientConfig{ClientID: id, Conn: conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			got <- pr.Packet
			return true, nil
		}}})
	if cp == nil {
		cp = &paho.Connect{CleanStart: true}
	}
	cp.ClientID, cp.KeepAlive = id, 30
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, cp)
	if err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect %s: %v %+v", id, err, ca)
	}
	t.Cleanup(func() { _ = c.Disconnect(&paho.Disconnect{}) })
	return c, got
}
