package mqtt

import (
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// serialLog is a memLog whose done callbacks all run on one goroutine, in
// the order the log resolved them, as the daemon's ack queue runs them: a
// callback that waited for one client would hold every client's acks.
type serialLog struct {
	*memLog
	q chan func()
}

func newSerialLog(t *testing.T) *serialLog {
	l := &serialLog{memLog: newMemLog(), q: make(chan func(), 1<<14)}
	stop := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		for {
			select {
			case f := <-l.q:
				f()
			case <-stop:
				return
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-ended })
	return l
}

// serialServer is testServer proposing through l, a wrapper of mem, with
// inline ack writes on.
func serialServer(t *testing.T, l Log, mem *memLog, mutate func(*Config)) *Server {
	t.Helper()
	cfg := Config{Listen: "127.0.0.1:0", AllowAnonymous: true, Sessions: mem.store, NodeID: 1}
	cfg.Limits.ConnectRate = -1
	if mutate != nil {
		mutate(&cfg)
	}
	s, err := NewServer(cfg, l)
	if err != nil {
		t.Fatal(err)
	}
	// The acks written by the goroutine that resolves them (kickHere)
	// are what these tests hold to the rules the writer goroutine keeps:
	// on here whatever NewServer's default.
	s.inlineWrites.Store(true)
	mem.mu.Lock()
	mem.srv = s
	mem.mu.Unlock()
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	applier := make(chan struct{})
	go func() {
		mem.apply()
		close(applier)
	}()
	t.Cleanup(func() { stopServer(t, s, mem, applier) })
	return s
}

func (l *serialLog) Propose(m *Message, mode AckMode, done Done) {
	l.memLog.Propose(m, mode, DoneFunc(func(err error) { l.q <- func() { done.Done(err) } }))
}

// A client that stops reading blocks only its own connection: its acks,
// written by the goroutine that resolves every connection's outcomes
// while its writer is idle, are written without waiting, and what its
// socket does not take goes to its own writer. Here its 200 refusals of
// 32 KiB each (0x97 with a long reason string) are far more than its
// socket holds, and another client's PUBACK, resolved after all of them,
// still comes.
func TestStuckClientDoesNotDelayAnotherClientsPuback(t *testing.T) {
	const stuckPubs = 200
	reason := strings.Repeat("r", 32<<10)
	var refused atomic.Int64
	log := newSerialLog(t)
	log.refuse = func(topic string) error {
		if strings.HasPrefix(topic, "stuck/") {
			refused.Add(1)
			return fmt.Errorf("%w: %s", ErrQuota, reason)
		}
		return nil
	}
	s := serialServer(t, log, log.memLog, func(c *Config) { c.AckReasonStrings, c.MaxInflight = true, 4*stuckPubs })

	// The stuck client's receive buffer is as small as the kernel allows.
	d := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) { serr = setRcvBuf(fd, 1024) }); err != nil {
			return err
		}
		return serr
	}}
	nc, err := d.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	stuck := &raw{t: t, c: nc, v: 5, rd: &bytesReader{nc}}
	stuck.connect("stuck", true, nil)
	for i := range stuckPubs {
		stuck.publish("stuck/x", 1, uint16(i+1), "p")
	}
	// It reads nothing from here on; every publish is read and refused.
	deadline := time.Now().Add(10 * time.Second)
	for refused.Load() < stuckPubs {
		if time.Now().After(deadline) {
			t.Fatalf("the server read %d of the stuck client's %d publishes", refused.Load(), stuckPubs)
		}
		time.Sleep(5 * time.Millisecond)
	}

	other := dialRaw(t, s.Addr(), 5)
	other.connect("other", true, nil)
	other.publish("ok/x", 1, 7, "hello")
	pk, err := other.read(10 * time.Second)
	if err != nil {
		t.Fatalf("no PUBACK for a client while another stopped reading: %v", err)
	}
	if pk.FixedHeader.Type != packets.Puback || pk.PacketID != 7 || pk.ReasonCode != 0 {
		t.Fatalf("got %+v (id %d, code %#x), want PUBACK 7 success", pk.FixedHeader, pk.PacketID, pk.ReasonCode)
	}
}

// [MQTT-4.6.0-2]: PUBACKs go out in the order the PUBLISHes came, though
// the log resolves them out of order and each is written by whoever
// resolved it while no writer ran: a publish resolved before the one
// ahead of it waits for it.
func TestMQTT_4_6_0_2_PubacksInTheOrderThePublishesCame(t *testing.T) {
	log := newSerialLog(t)
	held := make(chan func(), 16)
	s := serialServer(t, &holdingLog{serialLog: log, held: held}, log.memLog, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("order", true, nil)
	c.publish("held/1", 1, 1, "a")
	var release func()
	select {
	case release = <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("the first publish never reached the log")
	}
	for pid := uint16(2); pid <= 5; pid++ {
		c.publish("now/x", 1, pid, "b")
	}
	// Released once the four after it are resolved.
	deadline := time.Now().Add(10 * time.Second)
	for log.lastIndex() < 5 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 5 publishes reached the log", log.lastIndex())
		}
		time.Sleep(time.Millisecond)
	}
	ran := make(chan struct{})
	log.q <- func() { close(ran) } // after the four's callbacks
	<-ran
	release()
	for want := uint16(1); want <= 5; want++ {
		pk, err := c.read(10 * time.Second)
		if err != nil {
			t.Fatalf("waiting for PUBACK %d: %v", want, err)
		}
		if pk.FixedHeader.Type != packets.Puback || pk.PacketID != want {
			t.Fatalf("got type %d id %d, want PUBACK %d", pk.FixedHeader.Type, pk.PacketID, want)
		}
	}
}

// holdingLog resolves a publish to held/# only when the func it sends on
// held is called; everything else as serialLog does.
type holdingLog struct {
	*serialLog
	held chan func()
}

func (l *holdingLog) Propose(m *Message, mode AckMode, done Done) {
	if strings.HasPrefix(m.Topic, "held/") {
		l.memLog.Propose(m, mode, DoneFunc(func(err error) { l.held <- func() { l.q <- func() { done.Done(err) } } }))
		return
	}
	l.serialLog.Propose(m, mode, done)
}
