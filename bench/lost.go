package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/paho"
)

// lostCause remembers why a connection ended, as its client library's
// callback reports it, so that the publishes that fail because of it can
// say so. The callbacks run on goroutines of their own, possibly after
// the publish has already returned its error: explain waits a little for
// the cause.
type lostCause struct {
	once sync.Once
	done chan struct{} // closed once err is set
	err  error         // written once, before done is closed
	// ctx is cancelled with done: a publish waiting for an ack that
	// will never come stops at once rather than at paho's 10 s timeout.
	ctx    context.Context
	cancel context.CancelFunc
}

func newLostCause() *lostCause {
	ctx, cancel := context.WithCancel(context.Background())
	return &lostCause{done: make(chan struct{}), ctx: ctx, cancel: cancel}
}

// set records the first cause; later ones (paho reports the socket error
// after the DISCONNECT) add nothing.
func (l *lostCause) set(err error) {
	l.once.Do(func() { l.err = err; close(l.done); l.cancel() })
}

// bind returns ctx, also cancelled when the connection is lost.
func (l *lostCause) bind(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(l.ctx, cancel)
	return ctx, func() { stop(); cancel() }
}

// get returns the cause if the connection is known to be gone.
func (l *lostCause) get() error {
	select {
	case <-l.done:
		return l.err
	default:
		return nil
	}
}

// causeWait bounds how long explain waits for a callback that may not
// come (the publish failed for a reason of its own).
const causeWait = time.Second

// explain returns the connection's cause in place of err when the
// connection ended (err, a timeout or a closed socket, is only its
// consequence), err itself otherwise.
func (l *lostCause) explain(err error) error {
	t := time.NewTimer(causeWait)
	defer t.Stop()
	select {
	case <-l.done:
		return l.err
	case <-t.C:
		return err
	}
}

// reasonNames are the MQTT 5 DISCONNECT reason codes a broker sends
// (MQTT 5 section 3.14.2.1), in the spec's words.
var reasonNames = map[byte]string{
	0x00: "normal disconnection",
	0x80: "unspecified error",
	0x81: "malformed packet",
	0x82: "protocol error",
	0x83: "implementation specific error",
	0x87: "not authorized",
	0x89: "server busy",
	0x8B: "server shutting down",
	0x8D: "keep alive timeout",
	0x8E: "session taken over",
	0x8F: "topic filter invalid",
	0x90: "topic name invalid",
	0x93: "receive maximum exceeded",
	0x94: "topic alias invalid",
	0x95: "packet too large",
	0x96: "message rate too high",
	0x97: "quota exceeded",
	0x98: "administrative action",
	0x99: "payload format invalid",
	0x9A: "retain not supported",
	0x9B: "QoS not supported",
	0x9C: "use another server",
	0x9D: "server moved",
	0x9E: "shared subscriptions not supported",
	0x9F: "connection rate exceeded",
	0xA0: "maximum connect time",
	0xA1: "subscription identifiers not supported",
	0xA2: "wildcard subscriptions not supported",
}

// disconnectReason words a server's DISCONNECT: its reason code by name
// and number, and the reason string if it sent one.
func disconnectReason(d *paho.Disconnect) string {
	name, ok := reasonNames[d.ReasonCode]
	if !ok {
		name = "reason"
	}
	s := fmt.Sprintf("%s (%#02x)", name, d.ReasonCode)
	if d.Properties != nil && d.Properties.ReasonString != "" {
		s += ": " + d.Properties.ReasonString
	}
	return s
}
