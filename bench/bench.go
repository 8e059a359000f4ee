// Package bench is tandem's MQTT load generator, behind `tandem bench`: N
// publishing clients, each keeping a window of QoS 0/1/2 publishes in flight,
// and an optional subscriber that times end-to-end delivery. It works
// against any MQTT broker (3.1.1 through eclipse/paho.mqtt.golang, 5 through
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
	// times deliveries.
	Subscribe bool
	Username  string
	Password  string
	ClientID  string // prefix of the client ids
	// Progress is called about every 100 ms with the publishes acked so far.
	Progress func(acked int64)
}

// Result is what a workload measured.
type Result struct {
	Clients      int     `json:"clients"`
	QoS          byte    `json:"qos"`
	Size         int     `json:"size"`
	Window       int     `json:"window"`
	Sent         int64   `json:"sent"`
	Acked        int64   `json:"acked"`
	Failed       int64   `json:"failed"`
	Seconds      float64 `json:"seconds"`
	MsgPerSec    float64 `json:"msg_per_sec"`
	AckP50Ms     float64 `json:"ack_p50_ms"`
	AckP99Ms     float64 `json:"ack_p99_ms"`
	AckMaxMs     float64 `json:"ack_max_ms"`
	Received     int64   `json:"received,omitempty"`
	E2EP50Ms     float64 `json:"e2e_p50_ms,omitempty"`
	E2EP99Ms     float64 `json:"e2e_p99_ms,omitempty"`
	E2EMaxMs     float64 `json:"e2e_max_ms,omitempty"`
	FirstFailure string  `json:"first_failure,omitempty"`
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
	var sub *subscriber
	if o.Subscribe {
		var err error
		if sub, err = subscribe(ctx, o); err != nil {
			return nil, err
		}
		defer sub.close()
	}

	res := &Result{Clients: o.Clients, QoS: o.QoS, Size: o.Size, Window: o.Window}
	var acked, failed, sent atomic.Int64
	var firstErr atomic.Pointer[error]
	lat := make([][]time.Duration, o.Clients*o.Window)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	if o.Count == 0 {
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
	wg.Wait()
	res.Seconds = time.Since(start).Seconds()
	stopProgress()
	res.Sent, res.Acked, res.Failed = sent.Load(), acked.Load(), failed.Load()
	if e := firstErr.Load(); e != nil {
		res.FirstFailure = (*e).Error()
	}
	res.MsgPerSec = float64(res.Acked) / res.Seconds
	res.AckP50Ms, res.AckP99Ms, res.AckMaxMs = percentiles(slices.Concat(lat...))
	if sub != nil {
		e2e := sub.wait(res.Acked, 5*time.Second)
		res.Received = int64(len(e2e))
		res.E2EP50Ms, res.E2EP99Ms, res.E2EMaxMs = percentiles(e2e)
	}
	return res, nil
}

func (o *Options) fill() error {
	if o.Broker == "" {
		o.Broker = "127.0.0.1:1883"
	}
	if o.Clients <= 0 {
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
	if o.ClientID == "" {
		o.ClientID = fmt.Sprintf("tandem-bench-%d", time.Now().UnixNano()%1e6)
	}
	if o.Version == 0 {
		o.Version = 5
	}
	switch {
	case o.QoS > 2:
		return errors.New("bench: qos must be 0, 1 or 2")
	case o.Version != 3 && o.Version != 5:
		return errors.New("bench: mqtt version must be 3 or 5")
	case o.Subscribe && o.Size < 8:
		return errors.New("bench: --subscribe needs a payload of at least 8 bytes (it carries the send time)")
	case o.QoS == 0 && o.Window > 1:
		// QoS 0 has no ack: a window means nothing; run flat out.
		o.Window = 1
	}
	return nil
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
	return dial5(ctx, o, id, nil)
}

// v3 is a 3.1.1 connection.
type v3 struct{ c paho3.Client }

func dial3(o Options, id string) (*v3, error) {
	opts := paho3.NewClientOptions().AddBroker("tcp://" + o.Broker).SetClientID(id).
		SetCleanSession(true).SetAutoReconnect(false).SetOrderMatters(false).
		SetMaxResumePubInFlight(o.Window).SetKeepAlive(60 * time.Second).SetConnectTimeout(10 * time.Second)
	if o.Username != "" {
		opts.SetUsername(o.Username).SetPassword(o.Password)
	}
	c := paho3.NewClient(opts)
	if t := c.Connect(); !t.WaitTimeout(15*time.Second) || t.Error() != nil {
		return nil, fmt.Errorf("connect: %v", t.Error())
	}
	return &v3{c}, nil
}

func (p *v3) publish(ctx context.Context, topic string, qos byte, payload []byte) error {
	t := p.c.Publish(topic, qos, false, payload)
	select {
	case <-t.Done():
		return t.Error()
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *v3) close() { p.c.Disconnect(100) }

// v5 is an MQTT 5 connection.
type v5 struct{ c *paho.Client }

func dial5(ctx context.Context, o Options, id string, onPublish func(paho.PublishReceived) (bool, error)) (*v5, error) {
	conn, err := (&net.Dialer{Timeout: 10 * time.Second}).DialContext(ctx, "tcp", o.Broker)
	if err != nil {
		return nil, err
	}
	cfg := paho.ClientConfig{ClientID: id, Conn: conn}
	if onPublish != nil {
		cfg.OnPublishReceived = []func(paho.PublishReceived) (bool, error){onPublish}
	}
	c := paho.NewClient(cfg)
	cp := &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 60}
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
	return &v5{c}, nil
}

func (p *v5) publish(ctx context.Context, topic string, qos byte, payload []byte) error {
	r, err := p.c.Publish(ctx, &paho.Publish{Topic: topic, QoS: qos, Payload: payload})
	if err != nil {
		return err
	}
	if r != nil && r.ReasonCode >= 0x80 {
		return fmt.Errorf("refused: reason %#x", r.ReasonCode)
	}
	return nil
}

func (p *v5) close() { _ = p.c.Disconnect(&paho.Disconnect{}) }

// subscriber counts deliveries and their end-to-end latency.
type subscriber struct {
	c   *v5
	mu  sync.Mutex
	e2e []time.Duration
}

func subscribe(ctx context.Context, o Options) (*subscriber, error) {
	s := &subscriber{}
	c, err := dial5(ctx, o, o.ClientID+"-sub", func(pr paho.PublishReceived) (bool, error) {
		if len(pr.Packet.Payload) >= 8 {
			sentAt := int64(binary.BigEndian.Uint64(pr.Packet.Payload))
			s.mu.Lock()
			s.e2e = append(s.e2e, time.Duration(time.Now().UnixNano()-sentAt))
			s.mu.Unlock()
		}
		return true, nil
	})
	if err != nil {
		return nil, fmt.Errorf("subscriber: %w", err)
	}
	s.c = c
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := c.c.Subscribe(sctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: o.filter(), QoS: o.QoS}}}); err != nil {
		c.close()
		return nil, fmt.Errorf("subscribe: %w", err)
	}
	return s, nil
}

// wait waits until n deliveries arrived or quiet passes without one.
func (s *subscriber) wait(n int64, quiet time.Duration) []time.Duration {
	last, lastChange := -1, time.Now()
	for {
		s.mu.Lock()
		got := len(s.e2e)
		s.mu.Unlock()
		if int64(got) >= n || time.Since(lastChange) > quiet {
			s.mu.Lock()
			defer s.mu.Unlock()
			return append([]time.Duration(nil), s.e2e...)
		}
		if got != last {
			last, lastChange = got, time.Now()
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s *subscriber) close() { s.c.close() }
