package uplink

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/eclipse/paho.golang/paho/session"
	"github.com/eclipse/paho.golang/paho/session/state"
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
		if established {
			u.c.Disconnects++
			u.connected, u.since = false, time.Now()
		} else {
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

// entry is a message awaiting the cloud's ack.
type entry struct {
	index uint64
	size  int
	bytes int
	qos   byte
	resp  chan packets.ControlPacket // the ack, from the session
}

// connection dials, connects, forwards and brings the downlink in until
// the connection ends. established says whether CONNACK came.
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

	conn, err := u.dial(ctx)
	if err != nil {
		return false, err
	}
	sess := &ackSession{SessionManager: state.NewInMemory()}
	defer sess.Close()
	errc := make(chan error, 4)
	fail := func(err error) {
		select {
		case errc <- err:
		default:
		}
		cancel()
	}
	cc := paho.ClientConfig{
		ClientID:      u.cfg.ClientID,
		Conn:          conn,
		Session:       sess,
		PacketTimeout: u.cfg.ConnectTimeout,
		OnClientError: func(err error) { fail(fmt.Errorf("connection lost: %w", err)) },
		OnServerDisconnect: func(d *paho.Disconnect) {
			msg := fmt.Sprintf("the broker disconnected (reason 0x%02x)", d.ReasonCode)
			if d.Properties != nil && d.Properties.ReasonString != "" {
				msg += ": " + d.Properties.ReasonString
			}
			fail(errors.New(msg))
		},
	}
	if len(u.cfg.Downlink) > 0 {
		cc.OnPublishReceived = []func(paho.PublishReceived) (bool, error){
			func(pr paho.PublishReceived) (bool, error) { return true, u.downlink(ctx, sess, pr, fail) },
		}
	}
	client := paho.NewClient(cc)
	cp := &paho.Connect{
		ClientID:   u.cfg.ClientID,
		KeepAlive:  uint16(u.cfg.KeepAlive / time.Second),
		CleanStart: len(u.cfg.Downlink) == 0,
		Properties: &paho.ConnectProperties{},
	}
	if len(u.cfg.Downlink) > 0 {
		exp := uint32(u.cfg.SessionExpiry / time.Second)
		rm := uint16(u.cfg.MaxInflight)
		cp.Properties.SessionExpiryInterval = &exp
		cp.Properties.ReceiveMaximum = &rm
	}
	if u.cfg.Username != "" {
		cp.Username, cp.UsernameFlag = u.cfg.Username, true
	}
	if u.password != nil {
		cp.Password, cp.PasswordFlag = u.password, true
	}
	cctx, ccancel := context.WithTimeout(ctx, u.cfg.ConnectTimeout)
	ca, err := client.Connect(cctx, cp)
	ccancel()
	if err != nil {
		conn.Close()
		if ca != nil {
			msg := fmt.Sprintf("CONNACK reason 0x%02x", ca.ReasonCode)
			if ca.Properties != nil && ca.Properties.ReasonString != "" {
				msg += ": " + ca.Properties.ReasonString
			}
			return false, errors.New(msg)
		}
		if cctx.Err() != nil && ctx.Err() == nil {
			return false, fmt.Errorf("no CONNACK within %v", u.cfg.ConnectTimeout)
		}
		return false, fmt.Errorf("connect: %w", err)
	}
	defer func() {
		// cancel first: a downlink handler waiting on a local publish
		// holds up the client's shutdown.
		cancel()
		_ = client.Disconnect(&paho.Disconnect{ReasonCode: 0})
		<-client.Done()
	}()

	for _, d := range u.cfg.Downlink {
		sa, err := client.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: d.Remote, QoS: byte(ruleQoS(d.QoS))}}})
		if err == nil && len(sa.Reasons) == 1 && sa.Reasons[0] >= 0x80 {
			err = fmt.Errorf("SUBACK reason 0x%02x", sa.Reasons[0])
		}
		if err != nil {
			return true, fmt.Errorf("downlink subscribe %s: %w", d.Remote, err)
		}
	}

	u.mu.Lock()
	u.connected, u.since, u.lastErr = true, time.Now(), ""
	u.c.Connects++
	u.mu.Unlock()
	u.logger.Info("uplink connected", "broker", u.cfg.Broker)

	maxQoS, retainOK := byte(2), true
	if ca.Properties != nil {
		if ca.Properties.MaximumQoS != nil {
			maxQoS = *ca.Properties.MaximumQoS
		}
		retainOK = ca.Properties.RetainAvailable
	}
	// The window is the smaller of ours and the cloud's Receive Maximum:
	// past the latter paho would hold the sender for up to its packet
	// timeout and then fail the publish.
	window := u.cfg.MaxInflight
	if ca.Properties != nil && ca.Properties.ReceiveMaximum != nil {
		window = max(1, min(window, int(*ca.Properties.ReceiveMaximum)))
	}
	fifo := make(chan *entry, window)
	slots := make(chan struct{}, window)
	wg.Add(2)
	go func() {
		defer wg.Done()
		u.acker(ctx, fifo, slots, fail)
	}()
	go func() {
		defer wg.Done()
		u.sender(ctx, client, sess, fifo, slots, maxQoS, retainOK, fail)
	}()
	select {
	case <-ctx.Done():
	case <-client.Done():
	}
	// paho reports why only after the client is done, and a failed ping
	// races the read loop's "use of closed network connection" that its
	// own close causes: prefer the cause.
	var wait <-chan time.Time
	if ctx.Err() == nil {
		err = errors.New("connection lost")
		wait = time.After(time.Second)
	} else if len(errc) == 0 {
		return true, nil // stopped or paused
	}
	for {
		select {
		case e := <-errc:
			if err == nil || errors.Is(err, net.ErrClosed) || err.Error() == "connection lost" {
				err = e
			}
			if !errors.Is(err, net.ErrClosed) {
				return true, err
			}
			wait = time.After(200 * time.Millisecond)
		case <-wait:
			return true, err
		}
	}
}

// dial opens the network connection to the broker.
func (u *Uplink) dial(ctx context.Context) (net.Conn, error) {
	_, addr, _ := brokerAddr(u.cfg.Broker)
	d := &net.Dialer{Timeout: u.cfg.ConnectTimeout}
	if u.tlsConf == nil {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return packets.NewThreadSafeConn(c), nil
	}
	td := &tls.Dialer{NetDialer: d, Config: u.tlsConf}
	c, err := td.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	// tls.Conn is not safe for concurrent writes: paho writes from the
	// sender, the pinger and the ack tracker.
	return packets.NewThreadSafeConn(c), nil
}

// sender reads the log from the position and publishes, in log order,
// within the in-flight window and the rate cap.
func (u *Uplink) sender(ctx context.Context, client *paho.Client, sess *ackSession,
	fifo chan<- *entry, slots chan struct{}, maxQoS byte, retainOK bool, fail func(error)) {
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
		next = u.skipLost(next)
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
			if !u.publish(ctx, client, sess, fifo, r, rule, maxQoS, retainOK, fail) {
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
func (u *Uplink) publish(ctx context.Context, client *paho.Client, sess *ackSession, fifo chan<- *entry,
	r *Record, rule *TopicRule, maxQoS byte, retainOK bool, fail func(error)) bool {
	qos := min(byte(ruleQoS(rule.QoS)), maxQoS)
	e := &entry{index: r.Index, size: r.Size, bytes: len(r.Payload), qos: qos, resp: make(chan packets.ControlPacket, 1)}
	p := &paho.Publish{
		QoS:        qos,
		Retain:     r.Retain && retainOK,
		Topic:      rule.RemotePrefix + r.Topic,
		Payload:    r.Payload,
		Properties: publishProps(r),
	}
	u.mu.Lock()
	u.readUpTo = r.Index
	u.inflight++
	if r.Index <= u.highSent {
		u.c.Resent++
	} else {
		u.highSent = r.Index
	}
	u.mu.Unlock()
	fifo <- e // never blocks: the slot taken bounds the entries
	sess.next(e.resp)
	_, err := client.PublishWithOptions(ctx, p, paho.PublishOptions{Method: paho.PublishMethod_AsyncSend})
	sess.next(nil)
	if err != nil {
		fail(fmt.Errorf("publish %s: %w", p.Topic, err))
		return false
	}
	if qos == 0 {
		e.resp <- packets.ControlPacket{FixedHeader: packets.FixedHeader{Type: packets.PUBACK}, Content: &packets.Puback{}}
	}
	return true
}

// publishProps carries a record's MQTT 5 properties up, with tandem-id.
func publishProps(r *Record) *paho.PublishProperties {
	pr := &paho.PublishProperties{
		ContentType:     r.Props.ContentType,
		ResponseTopic:   r.Props.ResponseTopic,
		CorrelationData: r.Props.CorrelationData,
	}
	if r.Props.PayloadFormatSet {
		v := r.Props.PayloadFormat
		pr.PayloadFormat = &v
	}
	if r.Props.MessageExpirySet {
		// The time the record waited in the log counts against its expiry.
		left := int64(r.Props.MessageExpiry) - (time.Now().UnixNano()-r.Time)/int64(time.Second)
		v := uint32(max(left, 1))
		pr.MessageExpiry = &v
	}
	pr.User = make(paho.UserProperties, 0, len(r.Props.User)+1)
	for _, up := range r.Props.User {
		pr.User = append(pr.User, paho.UserProperty{Key: up.Key, Value: up.Value})
	}
	pr.User = append(pr.User, paho.UserProperty{Key: "tandem-id", Value: r.ID()})
	return pr
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
		var resp packets.ControlPacket
		select {
		case <-ctx.Done():
			return
		case resp = <-e.resp:
		}
		if err := ackError(e.qos, resp); err != nil {
			fail(fmt.Errorf("record %d: %w", e.index, err))
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

// ackError says what is wrong with the response to a publish at qos. A
// refusal keeps the record unacked: the connection is dropped and the
// record sent again after the backoff, so nothing refused is lost.
func ackError(qos byte, resp packets.ControlPacket) error {
	switch c := resp.Content.(type) {
	case *packets.Puback:
		if qos == 1 || qos == 0 {
			if c.ReasonCode >= 0x80 {
				return fmt.Errorf("PUBACK reason 0x%02x", c.ReasonCode)
			}
			return nil
		}
	case *packets.Pubcomp:
		if qos == 2 {
			if c.ReasonCode >= 0x80 {
				return fmt.Errorf("PUBCOMP reason 0x%02x", c.ReasonCode)
			}
			return nil
		}
	case *packets.Pubrec:
		if c.ReasonCode >= 0x80 {
			return fmt.Errorf("PUBREC reason 0x%02x", c.ReasonCode)
		}
	}
	return fmt.Errorf("no ack (packet type %d)", resp.Type)
}

// downlink publishes a message from the cloud locally. paho acks it at the
// cloud when this returns (handlers run one at a time, in arrival order, so
// acks go out in order and at once, where paho's manual acks would wait
// for a 50 ms flush that a reconnect can overtake, a duplicate). A failed
// local publish vetoes that ack and ends the connection: the cloud sends
// the message again on the next one.
func (u *Uplink) downlink(ctx context.Context, sess *ackSession, pr paho.PublishReceived, fail func(error)) error {
	p := pr.Packet
	var rule *DownlinkRule
	for i := range u.cfg.Downlink {
		if u.match(u.cfg.Downlink[i].Remote, p.Topic) {
			rule = &u.cfg.Downlink[i]
			break
		}
	}
	if rule == nil {
		// A subscription of an earlier config, kept in the cloud session:
		// acked and dropped.
		return nil
	}
	m := &Message{Topic: rule.LocalPrefix + p.Topic, QoS: p.QoS, Retain: p.Retain, Payload: p.Payload}
	if pp := p.Properties; pp != nil {
		m.Props.ContentType, m.Props.ResponseTopic, m.Props.CorrelationData = pp.ContentType, pp.ResponseTopic, pp.CorrelationData
		if pp.PayloadFormat != nil {
			m.Props.PayloadFormat, m.Props.PayloadFormatSet = *pp.PayloadFormat, true
		}
		if pp.MessageExpiry != nil {
			m.Props.MessageExpiry, m.Props.MessageExpirySet = *pp.MessageExpiry, true
		}
		for _, up := range pp.User {
			m.Props.User = append(m.Props.User, UserProperty{Key: up.Key, Value: up.Value})
		}
	}
	if err := u.local.Publish(ctx, m); err != nil {
		sess.veto()
		u.mu.Lock()
		u.c.DownlinkFailed++
		u.mu.Unlock()
		fail(fmt.Errorf("downlink %s: local publish: %w", p.Topic, err))
		return err
	}
	u.mu.Lock()
	u.c.DownlinkReceived++
	u.mu.Unlock()
	return nil
}

// ackSession is paho's session state with one addition: the sender hands
// it the channel on which the ack of the publish it is about to send must
// arrive. paho's asynchronous publish gives no ack otherwise, and its
// synchronous one holds the caller until the ack, which would allow one
// message in flight, or lose the order on the wire with several callers.
//
// It also lets the downlink veto the ack of the message it failed to
// publish locally.
type ackSession struct {
	session.SessionManager
	mu       sync.Mutex
	resp     chan packets.ControlPacket
	vetoNext bool
}

// veto drops the ack paho sends next (for the message whose handler is
// returning).
func (s *ackSession) veto() {
	s.mu.Lock()
	s.vetoNext = true
	s.mu.Unlock()
}

// Ack acks a downlink message at the cloud, unless vetoed.
func (s *ackSession) Ack(pb *packets.Publish) error {
	s.mu.Lock()
	v := s.vetoNext
	s.vetoNext = false
	s.mu.Unlock()
	if v {
		return nil
	}
	return s.SessionManager.Ack(pb)
}

// next sets the ack channel of the next PUBLISH (nil: none).
func (s *ackSession) next(c chan packets.ControlPacket) {
	s.mu.Lock()
	s.resp = c
	s.mu.Unlock()
}

// AddToSession routes the ack of an uplink PUBLISH to the sender's
// channel.
func (s *ackSession) AddToSession(ctx context.Context, p session.Packet, resp chan<- packets.ControlPacket) error {
	if p.Type() == packets.PUBLISH {
		s.mu.Lock()
		if s.resp != nil {
			resp = s.resp
			s.resp = nil
		}
		s.mu.Unlock()
	}
	return s.SessionManager.AddToSession(ctx, p, resp)
}
