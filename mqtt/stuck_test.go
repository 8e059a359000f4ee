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

func (l *serialLog) Propose(m *Message, mode AckMode, done func(error)) {
	l.memLog.Propose(m, mode, func(err error) { l.q <- func() { done(err) } })
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
	cfg := Config{Listen: "127.0.0.1:0", AllowAnonymous: true, Sessions: log.store, NodeID: 1, AckReasonStrings: true, MaxInflight: 4 * stuckPubs}
	cfg.Limits.ConnectRate = -1
	s, err := NewServer(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	log.srv = s
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	applier := make(chan struct{})
	go func() {
		log.apply()
		close(applier)
	}()
	t.Cleanup(func() { stopServer(t, s, log.memLog, applier) })

	// The stuck client's receive buffer is as small as the kernel allows.
	d := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 1024)
		}); err != nil {
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
