package uplink

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"sync"
	"time"

	mqtt3 "github.com/eclipse/paho.mqtt.golang"
)

// link311 is an MQTT 3.1.1 connection through eclipse/paho.mqtt.golang.
// 3.1.1 has no user properties: its messages carry no tandem-id.
type link311 struct {
	client mqtt3.Client
	win    int
	gone   chan struct{}
	once   sync.Once
	downs  chan mqtt3.Message // downlink messages, in arrival order
	wg     sync.WaitGroup
}

// downQueue bounds the downlink messages waiting for the local publish.
// paho.mqtt.golang's handlers must not block (they run on its reader when
// order matters), so they only queue.
const downQueue = 1024

// connect311 connects with paho.mqtt.golang and subscribes the downlink.
func (u *Uplink) connect311(ctx context.Context, fail func(error)) (link, error) {
	l := &link311{win: u.cfg.MaxInflight, gone: make(chan struct{}), downs: make(chan mqtt3.Message, downQueue)}
	opts := mqtt3.NewClientOptions()
	scheme := "tcp"
	if u.tlsConf != nil {
		scheme = "ssl"
	}
	_, addr, _ := brokerAddr(u.cfg.Broker)
	opts.AddBroker(scheme + "://" + addr)
	opts.SetClientID(u.cfg.ClientID)
	opts.SetProtocolVersion(4)
	opts.SetCleanSession(len(u.cfg.Downlink) == 0)
	opts.SetAutoReconnect(false)
	opts.SetConnectRetry(false)
	opts.SetKeepAlive(u.cfg.KeepAlive)
	opts.SetPingTimeout(u.cfg.KeepAlive)
	opts.SetConnectTimeout(u.cfg.ConnectTimeout)
	opts.SetWriteTimeout(u.cfg.ConnectTimeout)
	opts.SetOrderMatters(true)
	opts.SetAutoAckDisabled(true)
	opts.SetResumeSubs(false)
	if u.cfg.Username != "" {
		opts.SetUsername(u.cfg.Username)
	}
	if u.password != nil {
		opts.SetPassword(string(u.password))
	}
	// Our dialer, so that TLS and the connect timeout are the same as 5's
	// and a Stop cuts a dial short.
	opts.SetCustomOpenConnectionFn(func(*url.URL, mqtt3.ClientOptions) (net.Conn, error) { return u.dial(ctx) })
	// Every downlink message goes through one handler, also those a kept
	// session sends before our subscriptions are made again (they match
	// no subscription's handler yet, and unhandled ones are never acked).
	opts.SetDefaultPublishHandler(func(_ mqtt3.Client, m mqtt3.Message) {
		select {
		case l.downs <- m:
		case <-ctx.Done(): // unacked: the cloud sends it again
		}
	})
	opts.SetConnectionLostHandler(func(_ mqtt3.Client, err error) {
		fail(fmt.Errorf("connection lost: %w", err))
		l.once.Do(func() { close(l.gone) })
	})
	l.client = mqtt3.NewClient(opts)
	tok := l.client.Connect()
	select {
	case <-tok.Done():
	case <-ctx.Done():
		l.client.Disconnect(0)
		return nil, ctx.Err()
	case <-time.After(u.cfg.ConnectTimeout + time.Second):
		l.client.Disconnect(0)
		return nil, fmt.Errorf("no CONNACK within %v", u.cfg.ConnectTimeout)
	}
	if err := tok.Error(); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, fmt.Errorf("no CONNACK within %v: %w", u.cfg.ConnectTimeout, err)
		}
		return nil, fmt.Errorf("connect: %w", err)
	}
	if len(u.cfg.Downlink) > 0 {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			l.deliver(ctx, u, fail)
		}()
	}
	for _, d := range u.cfg.Downlink {
		st := l.client.Subscribe(d.Remote, byte(ruleQoS(d.QoS)), nil) // the default handler
		err := waitToken(ctx, st, u.cfg.ConnectTimeout)
		if err == nil {
			if q := st.(*mqtt3.SubscribeToken).Result()[d.Remote]; q == 0x80 {
				err = errors.New("SUBACK failure (0x80)")
			}
		}
		if err != nil {
			l.close()
			return nil, fmt.Errorf("downlink subscribe %s: %w", d.Remote, err)
		}
	}
	return l, nil
}

// deliver publishes downlink messages locally one at a time, in arrival
// order, and acks each at the cloud once its local publish returns.
func (l *link311) deliver(ctx context.Context, u *Uplink, fail func(error)) {
	for {
		var m mqtt3.Message
		select {
		case <-ctx.Done():
			return
		case m = <-l.downs:
		}
		rule := u.downlinkRule(m.Topic())
		if rule == nil {
			m.Ack()
			continue
		}
		lm := &Message{Topic: rule.LocalPrefix + m.Topic(), QoS: m.Qos(), Retain: m.Retained(), Payload: m.Payload()}
		if u.deliverDown(ctx, lm, fail) != nil {
			return
		}
		m.Ack()
	}
}

// waitToken waits for a paho.mqtt.golang token within d or until ctx ends.
func waitToken(ctx context.Context, t mqtt3.Token, d time.Duration) error {
	select {
	case <-t.Done():
		return t.Error()
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return fmt.Errorf("no answer within %v", d)
	}
}

func (l *link311) window() int           { return l.win }
func (l *link311) done() <-chan struct{} { return l.gone }

func (l *link311) close() {
	l.client.Disconnect(100)
	l.once.Do(func() { close(l.gone) })
	l.wg.Wait()
}

func (l *link311) publish(ctx context.Context, r *Record, rule *TopicRule) (func(context.Context) error, error) {
	qos := byte(ruleQoS(rule.QoS))
	t := l.client.Publish(rule.RemotePrefix+r.Topic, qos, r.Retain, r.Payload)
	// Publish has queued the packet for the writer (or failed): calls made
	// one after another go out in that order.
	select {
	case <-t.Done():
		if err := t.Error(); err != nil {
			return nil, err
		}
	default:
	}
	return func(ctx context.Context) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-l.gone:
			return errLost
		case <-t.Done():
			if err := t.Error(); err != nil {
				// paho.mqtt.golang fails the tokens in flight when the
				// connection goes: a consequence, reported as one.
				return fmt.Errorf("%w: %v", errLost, err)
			}
			return nil
		}
	}, nil
}
