// Package bench is tandem's MQTT load generator, behind `tandem bench`: N
// publishing clients, each keeping a window of QoS 0/1/2 publishes in flight,
// optional subscribers (fan-out) that count deliveries and time them end to
// end, and optional idle connections (CONNECT, then only keep-alive) for
// measuring a broker's memory per connection. It works against any MQTT
// broker (3.1.1 through eclipse/paho.mqtt.golang, 5 through
// eclipse/paho.golang), so a field engineer can compare brokers with it.
package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/eclipse/paho.golang/paho"
	paho3 "github.com/eclipse/paho.mqtt.golang"
)

// Options describe one workload.
type Options struct {
	Broker   string        // host:port
	Clients  int           // publishing connections
	Count    int           // publishes per client (0: run for Duration)
	Duration time.Duration // used when Count is 0
	QoS      byte
	Size     int // payload bytes (at least 8 with Subscribe: it carries the send time)
	Window   int // publishes in flight per client
	Topic    string
	Version  int // 3 (3.1.1) or 5
	// Subscribe adds one subscriber to Topic's filter that counts and
	// times deliveries (the same as Subscribers: 1).
	Subscribe bool
	// Subscribers is how many subscribers to Topic's filter count and
	// time deliveries: each receives every publish (fan-out). They speak
	// Version, as the publishers.
	Subscribers int
	// SubscribeQoS is the QoS of the subscriptions: 0, 1 or 2, or -1 for
	// the publishes' QoS. A delivery comes at the lower of the two; at 1
	// and 2 the subscribers acknowledge each one (the paho clients do,
	// after counting it).
	SubscribeQoS int
	// SubscriberReceiveMax is the Receive Maximum the MQTT 5 subscribers
	// send in CONNECT: how many QoS 1 and 2 deliveries the broker may
	// have unacknowledged on each. 0 means 20 (mosquitto_sub's default);
	// at most 65535. MQTT 3.1.1 has no such limit: ignored there.
	SubscriberReceiveMax int
	// Idle opens this many idle connections (CONNECT, then only keep-alive
	// pings) before the publishers and keeps them open until the run ends:
	// with Clients 0, for Duration (or not at all when Duration is 0).
	Idle     int
	Username string
	Password string
	ClientID string // prefix of the client ids
	// Progress is called about every 100 ms with the publishes acked so far.
	Progress func(acked int64)
}

// Result is what a workload measured.
type Result struct {
	Clients   int     `json:"clients"`
	QoS       byte    `json:"qos"`
	Size      int     `json:"size"`
	Window    int     `json:"window"`
	Sent      int64   `json:"sent"`
	Acked     int64   `json:"acked"`
	Failed    int64   `json:"failed"`
	Seconds   float64 `json:"seconds"`
	MsgPerSec float64 `json:"msg_per_sec"`
	AckP50Ms  float64 `json:"ack_p50_ms"`
	AckP99Ms  float64 `json:"ack_p99_ms"`
	AckMaxMs  float64 `json:"ack_max_ms"`
	// Subscribers and the rest up to E2EMaxMs are set with subscribers.
	Subscribers  int  `json:"subscribers,omitempty"`
	SubscribeQoS byte `json:"subscribe_qos,omitempty"`
	// Received counts the deliveries to all subscribers together;
	// ReceivedMin those to the subscriber that got the fewest.
	Received    int64 `json:"received,omitempty"`
	ReceivedMin int64 `json:"received_min,omitempty"`
	// DeliveredQoS is the highest QoS a delivery arrived with.
	DeliveredQoS byte `json:"delivered_qos,omitempty"`
	// DeliveriesPerSec is Received over the time from the first publish
	// to the last delivery.
	DeliveriesPerSec float64 `json:"deliveries_per_sec,omitempty"`
	E2EP50Ms         float64 `json:"e2e_p50_ms,omitempty"`
	E2EP99Ms         float64 `json:"e2e_p99_ms,omitempty"`
	E2EMaxMs         float64 `json:"e2e_max_ms,omitempty"`
	// Idle is how many idle connections were asked for, IdleOpen how
	// many were still open at the end, IdleConnectSeconds how long
	// opening them all took.
	Idle               int     `json:"idle,omitempty"`
	IdleOpen           int     `json:"idle_open,omitempty"`
	IdleConnectSeconds float64 `json:"idle_connect_seconds,omitempty"`
	FirstFailure       string  `json:"first_failure,omitempty"`
	// StorageWritten is what a tandem gateway's storage layer wrote per
	// acked publish, by file, when the caller read its /metrics around
	// the run (ReadStorageWritten; tandem bench --metrics).
	StorageWritten *StorageWritten `json:"storage_written_per_msg,omitempty"`
}

// publisher is one connection's publish call, whatever the MQTT version.
type publisher interface {
	publish(ctx context.Context, topic string, qos byte, payload []byte) error
	close()
}

// Run runs the workload and returns its measurements.
func Run(ctx context.Context, o Options) (*Result, error) {
	if err := o.fill(); err != nil {
		return nil, err
	}
	if err := RaiseFileLimit(uint64(o.Idle + o.Clients + o.Subscribers + 64)); err != nil {
		return nil, err
	}
	res := &Result{Clients: o.Clients, QoS: o.QoS, Size: o.Size, Window: o.Window, Idle: o.Idle}
	if o.Idle > 0 {
		t0 := time.Now()
		idle, err := OpenIdle(ctx, o, o.Idle)
		if err != nil {
			return nil, err
		}
		res.IdleConnectSeconds = time.Since(t0).Seconds()
		defer func() {
			res.IdleOpen = idle.Open()
			idle.Close()
		}()
	}
	pubs := make([]publisher, o.Clients)
	for i := range pubs {
		p, err := dial(ctx, o, fmt.Sprintf("%s-pub-%d", o.ClientID, i))
		if err != nil {
			for _, q := range pubs[:i] {
				q.close()
			}
			return nil, fmt.Errorf("client %d: %w", i, err)
		}
		pubs[i] = p
	}
	defer func() {
		for _, p := range pubs {
			p.close()
		}
	}()
	subs := make([]*subscriber, 0, o.Subscribers)
	defer func() {
		for _, s := range subs {
			s.close()
		}
	}()
	for i := 0; i < o.Subscribers; i++ {
		s, err := subscribe(ctx, o, fmt.Sprintf("%s-sub-%d", o.ClientID, i))
		if err != nil {
			return nil, fmt.Errorf("subscriber %d: %w", i, err)
		}
		subs = append(subs, s)
	}

	var acked, failed, sent atomic.Int64
	var firstErr atomic.Pointer[error]
	lat := make([][]time.Duration, o.Clients*o.Window)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	if o.Count == 0 || o.Clients == 0 {
		runCtx, cancel = context.WithTimeout(ctx, o.Duration)
		defer cancel()
	}
	stopProgress := o.progress(&acked)
	start := time.Now()
	var wg sync.WaitGroup
	for c := range pubs {
		var next atomic.Int64 // this client's next sequence number
		topic := o.topicFor(c)
		for w := 0; w < o.Window; w++ {
			wg.Add(1)
			go func(slot int) {
				defer wg.Done()
				payload := make([]byte, o.Size)
				for runCtx.Err() == nil {
					n := next.Add(1)
					if o.Count > 0 && n > int64(o.Count) {
						return
					}
					if o.Size >= 8 {
						binary.BigEndian.PutUint64(payload, uint64(time.Now().UnixNano()))
					}
					t0 := time.Now()
					sent.Add(1)
					err := pubs[c].publish(runCtx, topic, o.QoS, payload)
					if err != nil {
						if runCtx.Err() != nil && o.Count == 0 {
							return // the duration ran out mid-publish
						}
						failed.Add(1)
						firstErr.CompareAndSwap(nil, &err)
						continue
					}
					lat[slot] = append(lat[slot], time.Since(t0))
					acked.Add(1)
				}
			}(c*o.Window + w)
		}
	}
	if o.Clients == 0 && o.Duration > 0 {
		<-runCtx.Done() // only idle connections: hold them for Duration
	}
	wg.Wait()
	res.Seconds = time.Since(start).Seconds()
	stopProgress()
	res.Sent, res.Acked, res.Failed = sent.Load(), acked.Load(), failed.Load()
	if e := firstErr.Load(); e != nil {
		res.FirstFailure = (*e).Error()
	}
	if res.Seconds > 0 {
		res.MsgPerSec = float64(res.Acked) / res.Seconds
	}
	res.AckP50Ms, res.AckP99Ms, res.AckMaxMs = percentiles(slices.Concat(lat...))
	if len(subs) > 0 {
		waitDeliveries(subs, res.Acked, 5*time.Second)
		res.Subscribers, res.SubscribeQoS = len(subs), byte(o.SubscribeQoS)
		res.ReceivedMin = subs[0].n.Load()
		var e2e []time.Duration
		var last int64
		for _, s := range subs {
			n, d := s.results()
			res.Received += n
			res.ReceivedMin = min(res.ReceivedMin, n)
			res.DeliveredQoS = max(res.DeliveredQoS, byte(s.maxQoS.Load()))
			last = max(last, s.last.Load())
			e2e = append(e2e, d...)
		}
		if span := time.Duration(last - start.UnixNano()); res.Received > 0 && span > 0 {
			res.DeliveriesPerSec = float64(res.Received) / span.Seconds()
		}
		res.E2EP50Ms, res.E2EP99Ms, res.E2EMaxMs = percentiles(e2e)
	}
	return res, nil
}

func (o *Options) fill() error {
	o.fillConn()
	if o.Clients == 0 && o.Idle == 0 {
		o.Clients = 1
	}
	if o.Window <= 0 {
		o.Window = 1
	}
	if o.Count == 0 && o.Duration == 0 {
		o.Count = 1000
	}
	if o.Topic == "" {
		o.Topic = "bench/%c"
	}
	if o.Subscribe && o.Subscribers == 0 {
		o.Subscribers = 1
	}
	o.Subscribe = o.Subscribers > 0
	if o.SubscribeQoS < 0 {
		o.SubscribeQoS = int(o.QoS)
	}
	if o.SubscriberReceiveMax == 0 {
		o.SubscriberReceiveMax = 20
	}
	switch {
	case o.QoS > 2:
		return errors.New("bench: qos must be 0, 1 or 2")
	case o.Version != 3 && o.Version != 5:
		return errors.New("bench: mqtt version must be 3 or 5")
	case o.SubscribeQoS > 2:
		return errors.New("bench: the subscribers' qos must be 0, 1 or 2")
	case o.Clients < 0 || o.Subscribers < 0 || o.Idle < 0:
		return errors.New("bench: the numbers of clients, subscribers and idle connections cannot be negative")
	case o.SubscriberReceiveMax < 0 || o.SubscriberReceiveMax > 65535:
		return errors.New("bench: the subscribers' receive maximum must be 1 to 65535")
	case o.Subscribe && o.Size < 8:
		return errors.New("bench: --subscribe needs a payload of at least 8 bytes (it carries the send time)")
	case o.QoS == 0 && o.Window > 1:
		// QoS 0 has no ack: a window means nothing; run flat out.
		o.Window = 1
	}
	return nil
}

// fillConn sets what any connection needs: broker, version, client ids.
func (o *Options) fillConn() {
	if o.Broker == "" {
		o.Broker = "127.0.0.1:1883"
	}
	if o.ClientID == "" {
		o.ClientID = fmt.Sprintf("tandem-bench-%d", time.Now().UnixNano()%1e6)
	}
	if o.Version == 0 {
		o.Version = 5
	}
}

// topicFor expands %c (client number) in the topic.
func (o *Options) topicFor(c int) string { return strings.ReplaceAll(o.Topic, "%c", strconv.Itoa(c)) }

// filter is the subscriber's filter: the topic with %c as a wildcard level.
func (o *Options) filter() string { return strings.ReplaceAll(o.Topic, "%c", "+") }

func (o *Options) progress(acked *atomic.Int64) func() {
	if o.Progress == nil {
		return func() {}
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				o.Progress(acked.Load())
			case <-done:
				o.Progress(acked.Load())
				return
			}
		}
	}()
	return func() { close(done); <-stopped }
}

// percentiles returns p50, p99 and max in milliseconds.
func percentiles(d []time.Duration) (p50, p99, max float64) {
	if len(d) == 0 {
		return 0, 0, 0
	}
	slices.Sort(d)
	ms := func(x time.Duration) float64 { return float64(x) / 1e6 }
	return ms(d[len(d)*50/100]), ms(d[min(len(d)-1, len(d)*99/100)]), ms(d[len(d)-1])
}

func dial(ctx context.Context, o Options, id string) (publisher, error) {
	if o.Version == 3 {
		return dial3(o, id)
	}
	return dial5(ctx, o, id, 0, nil)
}

// v3 is a 3.1.1 connection.
type v3 struct {
	c    paho3.Client
	lost *lostCause
}

func dial3(o Options, id string) (*v3, error) {
	return dial3With(o, id, nil)
}

// dial3With connects a 3.1.1 client; onPublish, if set, handles every
// delivery (paho acknowledges a QoS 1 or 2 one once it returns).
func dial3With(o Options, id string, onPublish paho3.MessageHandler) (*v3, error) {
	opts := paho3.NewClientOptions().AddBroker("tcp://" + o.Broker).SetClientID(id).
		SetCleanSession(true).SetAutoReconnect(false).SetOrderMatters(false).
		SetMaxResumePubInFlight(o.Window).SetKeepAlive(60 * time.Second).SetConnectTimeout(10 * time.Second)
	if o.Username != "" {
		opts.SetUsername(o.Username).SetPassword(o.Password)
	}
	if onPublish != nil {
		opts.SetDefaultPublishHandler(onPublish)
	}
	// A 3.1.1 broker says nothing when it drops a client (no DISCONNECT
	// from the server before MQTT 5): the lost connection is the reason.
	lost := newLostCause()
	opts.SetConnectionLostHandler(func(_ paho3.Client, err error) {
		lost.set(fmt.Errorf("connection lost (the broker closed it; its log says why): %w", err))
	})
	c := paho3.NewClient(opts)
	if t := c.Connect(); !t.WaitTimeout(15*time.Second) || t.Error() != nil {
		return nil, fmt.Errorf("connect: %v", t.Error())
	}
	return &v3{c, lost}, nil
}

func (p *v3) publish(ctx context.Context, topic string, qos byte, payload []byte) error {
	if err := p.lost.get(); err != nil {
		return err // the connection is gone: fail now, not after a timeout
	}
	t := p.c.Publish(topic, qos, false, payload)
	select {
	case <-t.Done():
		if err := t.Error(); err != nil {
			return p.lost.explain(err)
		}
		return nil
	case <-ctx.Done():
		return ctx.Err() // the run ended (its duration, Ctrl-C)
	}
}

func (p *v3) close() { p.c.Disconnect(100) }

// v5 is an MQTT 5 connection.
type v5 struct {
	c    *paho.Client
	lost *lostCause
}

// dial5 connects an MQTT 5 client. With receiveMax > 0 it sends that
// Receive Maximum; onPublish, if set, handles every delivery (paho
// acknowledges a QoS 1 or 2 one once it returns).
func dial5(ctx context.Context, o Options, id string, receiveMax uint16, onPublish func(paho.PublishReceived) (bool, error)) (*v5, error) {
	conn, err := (&net.Dialer{Timeout: 10 * time.Second}).DialContext(ctx, "tcp", o.Broker)
	if err != nil {
		return nil, err
	}
	lost := newLostCause()
	cfg := paho.ClientConfig{ClientID: id, Conn: conn,
		// The broker's DISCONNECT carries its reason (packet too large,
		// quota exceeded, ...): without these, a publish it never acked
		// only fails with paho's "context deadline exceeded".
		OnServerDisconnect: func(d *paho.Disconnect) {
			lost.set(fmt.Errorf("broker disconnected the client: %s", disconnectReason(d)))
		},
		OnClientError: func(err error) { lost.set(fmt.Errorf("connection lost: %w", err)) },
	}
	if onPublish != nil {
		cfg.OnPublishReceived = []func(paho.PublishReceived) (bool, error){onPublish}
	}
	c := paho.NewClient(cfg)
	cp := &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 60}
	if receiveMax > 0 {
		cp.Properties = &paho.ConnectProperties{ReceiveMaximum: &receiveMax}
	}
	if o.Username != "" {
		cp.Username, cp.UsernameFlag = o.Username, true
		cp.Password, cp.PasswordFlag = []byte(o.Password), true
	}
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	ca, err := c.Connect(cctx, cp)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("connect: %w", err)
	}
	if ca.ReasonCode != 0 {
		conn.Close()
		return nil, fmt.Errorf("connect: reason %#x", ca.ReasonCode)
	}
	return &v5{c, lost}, nil
}

func (p *v5) publish(ctx context.Context, topic string, qos byte, payload []byte) error {
	if err := p.lost.get(); err != nil {
		return err // the connection is gone: fail now, not after a timeout
	}
	pctx, done := p.lost.bind(ctx)
	defer done()
	r, err := p.c.Publish(pctx, &paho.Publish{Topic: topic, QoS: qos, Payload: payload})
	if err != nil && ctx.Err() != nil {
		return err // the run ended (its duration, Ctrl-C): nothing to explain
	}
	if err != nil {
		return p.lost.explain(err)
	}
	if r != nil && r.ReasonCode >= 0x80 {
		return fmt.Errorf("refused: reason %#x", r.ReasonCode)
	}
	return nil
}

func (p *v5) close() { _ = p.c.Disconnect(&paho.Disconnect{}) }

// subscriber is one subscribing connection: it counts deliveries and
// their end-to-end latency.
type subscriber struct {
	close  func()
	n      atomic.Int64 // deliveries
	last   atomic.Int64 // when the last one arrived, UnixNano
	maxQoS atomic.Int32
	target atomic.Int64 // deliveries expected, once known
	once   sync.Once
	done   chan struct{} // closed once target deliveries arrived
	mu     sync.Mutex
	e2e    []time.Duration
}

func subscribe(ctx context.Context, o Options, id string) (*subscriber, error) {
	s := &subscriber{done: make(chan struct{})}
	qos := byte(o.SubscribeQoS)
	if o.Version == 3 {
		c, err := dial3With(o, id, func(_ paho3.Client, m paho3.Message) { s.deliver(m.Qos(), m.Payload()) })
		if err != nil {
			return nil, err
		}
		t := c.c.Subscribe(o.filter(), qos, nil)
		if !t.WaitTimeout(10*time.Second) || t.Error() != nil {
			c.close()
			return nil, fmt.Errorf("subscribe: %v", t.Error())
		}
		if st, ok := t.(*paho3.SubscribeToken); ok {
			if rc := st.Result()[o.filter()]; rc > 2 {
				c.close()
				return nil, fmt.Errorf("subscribe: refused (%#x)", rc)
			}
		}
		s.close = c.close
		return s, nil
	}
	c, err := dial5(ctx, o, id, uint16(o.SubscriberReceiveMax), func(pr paho.PublishReceived) (bool, error) {
		s.deliver(pr.Packet.QoS, pr.Packet.Payload)
		return true, nil
	})
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	sa, err := c.c.Subscribe(sctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: o.filter(), QoS: qos}}})
	if err != nil {
		c.close()
		return nil, fmt.Errorf("subscribe: %w", err)
	}
	if len(sa.Reasons) == 1 && sa.Reasons[0] >= 0x80 {
		c.close()
		return nil, fmt.Errorf("subscribe: refused (%#x)", sa.Reasons[0])
	}
	s.close = c.close
	return s, nil
}

// deliver counts one delivery; its payload starts with the send time.
func (s *subscriber) deliver(qos byte, payload []byte) {
	now := time.Now()
	if len(payload) >= 8 {
		sentAt := int64(binary.BigEndian.Uint64(payload))
		s.mu.Lock()
		s.e2e = append(s.e2e, time.Duration(now.UnixNano()-sentAt))
		s.mu.Unlock()
	}
	for q := int32(qos); ; {
		m := s.maxQoS.Load()
		if q <= m || s.maxQoS.CompareAndSwap(m, q) {
			break
		}
	}
	s.last.Store(now.UnixNano())
	if n, t := s.n.Add(1), s.target.Load(); t > 0 && n >= t {
		s.once.Do(func() { close(s.done) })
	}
}

// expect tells the subscriber how many deliveries make it done.
func (s *subscriber) expect(n int64) {
	s.target.Store(n)
	if n <= 0 || s.n.Load() >= n {
		s.once.Do(func() { close(s.done) })
	}
}

// results returns the deliveries counted and their latencies.
func (s *subscriber) results() (int64, []time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n.Load(), append([]time.Duration(nil), s.e2e...)
}

// waitDeliveries waits until every subscriber has n deliveries, or until
// quiet passes without a new one reaching any of them.
func waitDeliveries(subs []*subscriber, n int64, quiet time.Duration) {
	total := func() (t int64) {
		for _, s := range subs {
			t += s.n.Load()
		}
		return t
	}
	for _, s := range subs {
		s.expect(n)
	}
	timer := time.NewTimer(quiet)
	defer timer.Stop()
	seen := total()
	for _, s := range subs {
		for waiting := true; waiting; {
			select {
			case <-s.done:
				waiting = false
			case <-timer.C:
				now := total()
				if now == seen {
					return
				}
				seen = now
				timer.Reset(quiet)
			}
		}
	}
}
