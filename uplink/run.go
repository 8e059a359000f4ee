package uplink

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// errPaused ends a connection attempt that a pause overtook.
var errPaused = errors.New("paused")

// readBatch is how many log indexes the sender reads at a time.
const readBatch = 256

// run connects, forwards until the connection ends, and connects again
// after a backoff, until stopc closes.
func (u *Uplink) run(stopc chan struct{}) {
	defer u.wg.Done()
	u.catchUp(stopc)
	attempt := 0
	for {
		if !u.idle(stopc, attempt) {
			return
		}
		established, err := u.connection(stopc)
		if errors.Is(err, errPaused) {
			continue
		}
		select {
		case <-stopc:
			err = nil // an attempt that Stop cut short is no error
		default:
		}
		u.mu.Lock()
		if u.paused && !established {
			err = nil // nor one that Pause did
		}
		if established {
			u.c.Disconnects++
			u.connected, u.since = false, time.Now()
		} else if err != nil {
			u.c.ConnectFailures++
			if u.since.IsZero() {
				u.since = time.Now()
			}
		}
		// What was in flight is sent again from the position.
		u.readUpTo, u.inflight = u.pos, 0
		u.cutConn = nil
		u.mu.Unlock()
		u.setError(err)
		if established {
			attempt = 1
		} else {
			attempt++
		}
	}
}

// idle waits out the backoff before connection attempt number attempt,
// and a pause, dropping the oldest records meanwhile if on_full says so.
// It returns false when stopc closes.
func (u *Uplink) idle(stopc chan struct{}, attempt int) bool {
	deadline := time.Now().Add(u.backoff(attempt))
	for {
		u.catchUp(stopc)
		u.dropExcess(stopc)
		u.mu.Lock()
		paused := u.paused
		u.mu.Unlock()
		wait := time.Until(deadline)
		if !paused && wait <= 0 {
			return true
		}
		var t *time.Timer
		var timer <-chan time.Time
		if !paused {
			t = time.NewTimer(wait)
			timer = t.C
		}
		select {
		case <-stopc:
			return false
		case <-u.wake:
		case <-timer:
		}
		if t != nil {
			t.Stop()
		}
	}
}

// catchUp counts into the backlog the records between what is counted and
// what is committed: after Start, the records Notify named before it.
func (u *Uplink) catchUp(stopc chan struct{}) {
	for {
		u.mu.Lock()
		from, to := u.counted+1, u.committed
		if from > to {
			u.caughtUp = true
			u.mu.Unlock()
			return
		}
		u.mu.Unlock()
		var n, b int64
		err := u.log.Committed(from, to, func(r *Record) bool {
			if u.ruleFor(r.Topic) != nil {
				n++
				b += int64(r.Size)
			}
			select {
			case <-stopc:
				return false
			default:
				return true
			}
		})
		if err != nil {
			u.setError(fmt.Errorf("reading the log: %w", err))
			return
		}
		select {
		case <-stopc:
			return
		default:
		}
		u.mu.Lock()
		u.counted = to
		u.backlogN += n
		u.backlogB += b
		u.mu.Unlock()
	}
}

// overLocked reports whether drop_oldest must drop a record now.
func (u *Uplink) overLocked() bool {
	return u.cfg.OnFull == OnFullDropOldest && u.cfg.MaxBacklog > 0 && u.backlogB > u.cfg.MaxBacklog
}

// dropLocked drops record r (drop_oldest): it counts as dealt with.
func (u *Uplink) dropLocked(r *Record) {
	u.backlogN--
	u.backlogB -= int64(r.Size)
	u.c.Dropped++
	u.readUpTo = r.Index
	if u.inflight == 0 {
		u.pos = r.Index
	}
	if !u.dropping {
		u.dropping = true
		u.logger.Warn("uplink backlog over max_backlog: dropping the oldest records", "max_backlog", u.cfg.MaxBacklog)
	}
}

// skipLocked notes that the records up to index need nothing (not ours).
func (u *Uplink) skipLocked(index uint64) {
	if index > u.readUpTo {
		u.readUpTo = index
	}
	if u.inflight == 0 && u.readUpTo > u.pos {
		u.pos = u.readUpTo
	}
}

// dropExcess drops the oldest records while disconnected, as long as the
// backlog is over max_backlog and on_full is drop_oldest.
func (u *Uplink) dropExcess(stopc chan struct{}) {
	for {
		u.mu.Lock()
		over := u.overLocked()
		from, to := u.readUpTo+1, u.counted
		u.mu.Unlock()
		if !over || from > to {
			return
		}
		from = u.skipLost(from)
		to = min(to, from+readBatch-1)
		err := u.log.Committed(from, to, func(r *Record) bool {
			u.mu.Lock()
			defer u.mu.Unlock()
			if u.ruleFor(r.Topic) == nil {
				u.skipLocked(r.Index)
				return true
			}
			if !u.overLocked() {
				return false
			}
			u.dropLocked(r)
			return true
		})
		if err != nil {
			u.setError(fmt.Errorf("reading the log: %w", err))
			return
		}
		u.mu.Lock()
		if u.overLocked() {
			u.skipLocked(to)
		}
		u.mu.Unlock()
		select {
		case <-stopc:
			return
		default:
		}
	}
}

// skipLost moves from past what retention dropped, counting it lost, and
// recounts the backlog (it held the lost records).
func (u *Uplink) skipLost(from uint64) uint64 {
	first := u.log.FirstIndex()
	if first <= from {
		return from
	}
	u.mu.Lock()
	u.c.Lost += first - from
	u.skipLocked(first - 1)
	to := u.counted
	u.mu.Unlock()
	u.logger.Warn("uplink fell behind the log's retention: records lost", "from", from, "to", first-1)
	var n, b int64
	if err := u.log.Committed(first, to, func(r *Record) bool {
		if u.ruleFor(r.Topic) != nil {
			n++
			b += int64(r.Size)
		}
		return true
	}); err == nil {
		u.mu.Lock()
		u.backlogN, u.backlogB = n, b
		u.mu.Unlock()
	}
	return first
}

// link is one established connection to the cloud, over the client
// library its protocol needs (paho.golang for 5, paho.mqtt.golang for
// 3.1.1).
type link interface {
	// publish sends r under rule, in call order on the wire; wait then
	// blocks until the cloud acks it (nil), refuses it, or ctx ends.
	publish(ctx context.Context, r *Record, rule *TopicRule) (wait func(context.Context) error, err error)
	// window is how many messages may await their ack.
	window() int
	// done is closed when the connection is gone.
	done() <-chan struct{}
	// close disconnects and waits for the library's goroutines.
	close()
}

// entry is a message awaiting the cloud's ack.
type entry struct {
	index uint64
	size  int
	bytes int
	wait  func(context.Context) error
}

// connection connects, forwards and brings the downlink in until the
// connection ends. established says whether the broker accepted it.
func (u *Uplink) connection(stopc chan struct{}) (established bool, err error) {
	// Every goroutine started here is waited for, after cancel.
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	u.mu.Lock()
	if u.paused {
		u.mu.Unlock()
		return false, errPaused
	}
	u.cutConn = cancel
	u.mu.Unlock()
	wg.Add(1)
	go func() {
		defer wg.Done()
		select {
		case <-stopc:
			cancel()
		case <-ctx.Done():
		}
	}()

	errc := make(chan error, 4)
	fail := func(err error) {
		select {
		case errc <- err:
		default:
		}
		cancel()
	}
	var l link
	if u.cfg.Protocol == "3.1.1" {
		l, err = u.connect311(ctx, fail)
	} else {
		l, err = u.connect5(ctx, fail)
	}
	if err != nil {
		return false, err
	}
	defer func() {
		// cancel first: a downlink handler waiting on a local publish
		// holds up the client's shutdown.
		cancel()
		l.close()
	}()

	u.mu.Lock()
	u.connected, u.since, u.lastErr = true, time.Now(), ""
	u.c.Connects++
	u.mu.Unlock()
	u.logger.Info("uplink connected", "broker", u.cfg.Broker, "protocol", u.cfg.Protocol)

	fifo := make(chan *entry, l.window())
	slots := make(chan struct{}, l.window())
	wg.Add(2)
	go func() {
		defer wg.Done()
		u.acker(ctx, fifo, slots, fail)
	}()
	go func() {
		defer wg.Done()
		u.sender(ctx, l, fifo, slots, fail)
	}()
	select {
	case <-ctx.Done():
	case <-l.done():
	}
	// The libraries report why only after the connection is gone, and a
	// failed ping races the read loop's "use of closed network
	// connection" that its own close causes: prefer the cause.
	var wait <-chan time.Time
	if ctx.Err() == nil {
		err = errLost
		wait = time.After(time.Second)
	} else if len(errc) == 0 {
		return true, nil // stopped or paused
	}
	for {
		select {
		case e := <-errc:
			if err == nil || consequence(err) {
				err = e
			}
			if !consequence(err) {
				return true, err
			}
			wait = time.After(200 * time.Millisecond)
		case <-wait:
			return true, err
		}
	}
}

// errLost is a connection's end as a consequence: its cause, if one is
// reported, says more.
var errLost = errors.New("connection lost")

// consequence reports whether err only follows from the connection's end
// (a closed socket, a publish that lost its connection) rather than
// causing it.
func consequence(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, errLost)
}

// dial opens the network connection to the broker.
func (u *Uplink) dial(ctx context.Context) (net.Conn, error) {
	_, addr, _ := brokerAddr(u.cfg.Broker)
	d := &net.Dialer{Timeout: u.cfg.ConnectTimeout}
	if u.tlsConf == nil {
		return d.DialContext(ctx, "tcp", addr)
	}
	td := &tls.Dialer{NetDialer: d, Config: u.tlsConf}
	return td.DialContext(ctx, "tcp", addr)
}

// sender reads the log from the position and publishes, in log order,
// within the in-flight window and the rate cap.
func (u *Uplink) sender(ctx context.Context, l link, fifo chan<- *entry, slots chan struct{}, fail func(error)) {
	var lim *rate.Limiter
	if u.cfg.Rate > 0 {
		lim = rate.NewLimiter(rate.Limit(u.cfg.Rate), 1)
	}
	u.mu.Lock()
	next := u.pos + 1
	u.readUpTo = u.pos
	u.mu.Unlock()
	for ctx.Err() == nil {
		u.mu.Lock()
		to := u.counted
		u.mu.Unlock()
		if next > to {
			select {
			case <-ctx.Done():
				return
			case <-u.wake:
				continue
			}
		}
		if next = u.skipLost(next); next > to {
			continue
		}
		to = min(to, next+readBatch-1)
		complete := true
		err := u.log.Committed(next, to, func(r *Record) bool {
			u.mu.Lock()
			rule := u.ruleFor(r.Topic)
			if rule == nil {
				u.skipLocked(r.Index)
				u.mu.Unlock()
				return true
			}
			if u.overLocked() {
				u.dropLocked(r)
				u.mu.Unlock()
				return true
			}
			u.mu.Unlock()
			if lim != nil && lim.Wait(ctx) != nil {
				complete = false
				return false
			}
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
				complete = false
				return false
			}
			if !u.publish(ctx, l, fifo, r, rule, fail) {
				complete = false
				return false
			}
			return true
		})
		if err != nil {
			fail(fmt.Errorf("reading the log: %w", err))
			return
		}
		if !complete {
			return
		}
		u.mu.Lock()
		u.skipLocked(to)
		u.mu.Unlock()
		next = to + 1
	}
}

// publish sends r and queues its entry for the acker.
func (u *Uplink) publish(ctx context.Context, l link, fifo chan<- *entry, r *Record, rule *TopicRule, fail func(error)) bool {
	u.mu.Lock()
	u.readUpTo = r.Index
	u.inflight++
	if r.Index <= u.highSent {
		u.c.Resent++
	} else {
		u.highSent = r.Index
	}
	u.mu.Unlock()
	wait, err := l.publish(ctx, r, rule)
	if err != nil {
		fail(fmt.Errorf("publish %s: %w", rule.RemotePrefix+r.Topic, err))
		return false
	}
	fifo <- &entry{index: r.Index, size: r.Size, bytes: len(r.Payload), wait: wait} // never blocks: the slot taken bounds the entries
	return true
}

// acker takes the cloud's acks in send order and moves the position.
func (u *Uplink) acker(ctx context.Context, fifo <-chan *entry, slots chan struct{}, fail func(error)) {
	for {
		var e *entry
		select {
		case <-ctx.Done():
			return
		case e = <-fifo:
		}
		if err := e.wait(ctx); err != nil {
			if ctx.Err() == nil {
				fail(fmt.Errorf("record %d: %w", e.index, err))
			}
			return
		}
		<-slots
		u.mu.Lock()
		u.inflight--
		u.backlogN--
		u.backlogB -= int64(e.size)
		u.c.Forwarded++
		u.c.ForwardedBytes += uint64(e.bytes)
		u.sinceSave++
		if u.inflight == 0 {
			u.pos = max(u.pos, u.readUpTo)
		} else {
			u.pos = max(u.pos, e.index)
		}
		if u.dropping && !u.overLocked() {
			u.dropping = false
		}
		batch := u.sinceSave >= SaveAcks
		u.mu.Unlock()
		if batch {
			u.savePosition(false)
		}
	}
}

// downlinkRule is the downlink rule a message from the cloud on topic
// falls under, nil for none (a subscription of an earlier config, kept in
// the cloud session). A message whose local topic would start with $ matches none: $ topics
// are the server's, and no device, the cloud included, may write one
// (DESIGN.md, "The record").
func (u *Uplink) downlinkRule(topic string) *DownlinkRule {
	for i := range u.cfg.Downlink {
		if d := &u.cfg.Downlink[i]; u.match(d.Remote, topic) {
			if strings.HasPrefix(d.LocalPrefix+topic, "$") {
				return nil
			}
			return d
		}
	}
	return nil
}

// deliverDown publishes a downlink message locally; the caller acks it at
// the cloud only on nil. A failure also ends the connection: the cloud
// sends the message again on the next one.
func (u *Uplink) deliverDown(ctx context.Context, m *Message, fail func(error)) error {
	if err := u.local.Publish(ctx, m); err != nil {
		u.mu.Lock()
		u.c.DownlinkFailed++
		u.mu.Unlock()
		fail(fmt.Errorf("downlink %s: local publish: %w", m.Topic, err))
		return err
	}
	u.mu.Lock()
	u.c.DownlinkReceived++
	u.mu.Unlock()
	return nil
}
