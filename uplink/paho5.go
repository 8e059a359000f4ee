package uplink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/eclipse/paho.golang/paho/session"
	"github.com/eclipse/paho.golang/paho/session/state"

	"github.com/tandem-edge/tandem/internal/clock"
)

// link5 is an MQTT 5 connection through eclipse/paho.golang.
type link5 struct {
	client   *paho.Client
	sess     *ackSession
	maxQoS   byte
	retainOK bool
	win      int
}

// connect5 dials, connects and subscribes the downlink. fail ends the
// connection with a reason.
func (u *Uplink) connect5(ctx context.Context, fail func(error)) (link, error) {
	conn, err := u.dial(ctx)
	if err != nil {
		return nil, err
	}
	// paho writes from the sender, its pinger and acks: tls.Conn is not
	// safe for that. batchConn serialises them, and coalesces them into
	// fewer syscalls (batchconn.go).
	conn = newBatchConn(conn)
	sess := &ackSession{SessionManager: state.NewInMemory()}
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
			func(pr paho.PublishReceived) (bool, error) { return true, u.downlink5(ctx, sess, pr, fail) },
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
		_ = sess.Close()
		if ca != nil {
			msg := fmt.Sprintf("CONNACK reason 0x%02x", ca.ReasonCode)
			if ca.Properties != nil && ca.Properties.ReasonString != "" {
				msg += ": " + ca.Properties.ReasonString
			}
			return nil, errors.New(msg)
		}
		if cctx.Err() != nil && ctx.Err() == nil {
			return nil, fmt.Errorf("no CONNACK within %v", u.cfg.ConnectTimeout)
		}
		return nil, fmt.Errorf("connect: %w", err)
	}
	l := &link5{client: client, sess: sess, maxQoS: 2, retainOK: true, win: u.cfg.MaxInflight}
	if p := ca.Properties; p != nil {
		if p.MaximumQoS != nil {
			l.maxQoS = *p.MaximumQoS
		}
		l.retainOK = p.RetainAvailable
		// Past the cloud's Receive Maximum paho would hold the sender
		// for up to its packet timeout and then fail the publish.
		if p.ReceiveMaximum != nil {
			l.win = max(1, min(l.win, int(*p.ReceiveMaximum)))
		}
	}
	for _, d := range u.cfg.Downlink {
		sa, err := client.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: d.Remote, QoS: byte(ruleQoS(d.QoS))}}})
		if err == nil && len(sa.Reasons) == 1 && sa.Reasons[0] >= 0x80 {
			err = fmt.Errorf("SUBACK reason 0x%02x", sa.Reasons[0])
		}
		if err != nil {
			l.close()
			return nil, fmt.Errorf("downlink subscribe %s: %w", d.Remote, err)
		}
	}
	return l, nil
}

func (l *link5) window() int           { return l.win }
func (l *link5) done() <-chan struct{} { return l.client.Done() }

func (l *link5) close() {
	_ = l.client.Disconnect(&paho.Disconnect{ReasonCode: 0})
	<-l.client.Done()
	_ = l.sess.Close()
}

func (l *link5) publish(ctx context.Context, r *Record, rule *TopicRule) (func(context.Context) error, error) {
	qos := min(byte(ruleQoS(rule.QoS)), l.maxQoS)
	p := &paho.Publish{
		QoS:        qos,
		Retain:     r.Retain && l.retainOK,
		Topic:      rule.RemotePrefix + r.Topic,
		Payload:    r.Payload,
		Properties: publishProps(r),
	}
	resp := make(chan packets.ControlPacket, 1)
	l.sess.next(resp)
	_, err := l.client.PublishWithOptions(ctx, p, paho.PublishOptions{Method: paho.PublishMethod_AsyncSend})
	l.sess.next(nil)
	if errors.Is(err, paho.ErrNetworkErrorAfterStored) {
		return nil, fmt.Errorf("%w: %v", errLost, err) // the socket went: its cause says more
	}
	if err != nil {
		return nil, err
	}
	if qos == 0 {
		return func(context.Context) error { return nil }, nil
	}
	return func(ctx context.Context) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case c := <-resp:
			return ackError(qos, c)
		}
	}, nil
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
		left := int64(r.Props.MessageExpiry) - (clock.Now().UnixNano()-r.Time)/int64(time.Second)
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

// downlink5 publishes a message from the cloud locally. paho acks it at the
// cloud when this returns (handlers run one at a time, in arrival order, so
// acks go out in order and at once, where paho's manual acks would wait
// for a 50 ms flush that a reconnect can overtake, a duplicate). A failed
// local publish vetoes that ack and ends the connection: the cloud sends
// the message again on the next one.
func (u *Uplink) downlink5(ctx context.Context, sess *ackSession, pr paho.PublishReceived, fail func(error)) error {
	p := pr.Packet
	rule := u.downlinkRule(p.Topic)
	if rule == nil {
		return nil // acked and dropped
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
	err := u.deliverDown(ctx, m, fail)
	if err != nil {
		sess.veto()
	}
	return err
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
