package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// testGateway starts an in-process gateway on loopback with free ports.
func testGateway(t *testing.T, dir string, mutate func(*config.Config)) *Daemon {
	t.Helper()
	return startGatewayIn(t, dir, mutate, nil)
}

// startGatewayIn starts a gateway on dir with every listener on a free
// loopback port, its log (at INFO) in logs unless nil, and stops it when
// the test ends. The gateway starter of daemon's tests: it cannot live in
// internal/testutil, which daemon's own tests import (a cycle).
func startGatewayIn(tb testing.TB, dir string, mutate func(*config.Config), logs *testutil.Buffer) *Daemon {
	tb.Helper()
	cfg := config.DefaultConfig()
	cfg.Node.DataDir = dir
	cfg.Node.Name = "test"
	cfg.MQTT.Listen = "127.0.0.1:0"
	cfg.HTTP.Listen = "127.0.0.1:0"
	cfg.Peer.Listen = "127.0.0.1:0"
	if mutate != nil {
		mutate(cfg)
	}
	var log *slog.Logger
	if logs != nil {
		log = slog.New(slog.NewTextHandler(logs, nil))
	}
	d, err := New(cfg, log)
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := d.Start(ctx); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { d.Stop() })
	return d
}

// v5 connects an MQTT 5 client; received publishes go to the returned channel.
func v5(t *testing.T, addr, id string, cs *paho.Connect) (*paho.Client, chan *paho.Publish) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *paho.Publish, 1024)
	c := paho.NewClient(paho.ClientConfig{
		ClientID: id,
		Conn:     conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			got <- pr.Packet
			return true, nil
		}},
	})
	if cs == nil {
		cs = &paho.Connect{CleanStart: true}
	}
	cs.ClientID = id
	cs.KeepAlive = 30
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, cs)
	if err != nil {
		t.Fatalf("connect %s: %v", id, err)
	}
	if ca.ReasonCode != 0 {
		t.Fatalf("connect %s: reason %#x", id, ca.ReasonCode)
	}
	t.Cleanup(func() { _ = c.Disconnect(&paho.Disconnect{}) })
	return c, got
}

func subscribe(t *testing.T, c *paho.Client, filter string, qos byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	sa, err := c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: qos}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(sa.Reasons) != 1 || sa.Reasons[0] >= 0x80 {
		t.Fatalf("subscribe %s: reasons %v", filter, sa.Reasons)
	}
}

func publish(t *testing.T, c *paho.Client, p *paho.Publish) *paho.PublishResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := c.Publish(ctx, p)
	if err != nil {
		t.Fatalf("publish %s: %v", p.Topic, err)
	}
	return r
}

func receive(t *testing.T, ch chan *paho.Publish, within time.Duration) *paho.Publish {
	t.Helper()
	select {
	case p := <-ch:
		return p
	case <-time.After(within):
		t.Fatal("no publish received")
		return nil
	}
}

// logRecords reads every record of a gateway's log through its storage.
func logRecords(t *testing.T, d *Daemon) []storage.Record {
	t.Helper()
	var out []storage.Record
	err := d.db.Scan(1, func(e pbEntry) bool {
		if e.Type == 0 && len(e.Data) > 0 {
			r, err := storage.DecodeRecord(e.Data)
			if err != nil {
				t.Errorf("entry %d: %v", e.Index, err)
				return false
			}
			if r.Kind == storage.KindFeature {
				return true // the gateway's feature level, no device's
			}
			out = append(out, r)
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestPublishKeepsEveryPropertyToSubscribersAndLog(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	sub, got := v5(t, d.MQTTAddr(), "sub", nil)
	subscribe(t, sub, "props/#", 1)
	pub, _ := v5(t, d.MQTTAddr(), "pub", nil)
	pf := byte(1)
	exp := uint32(3600)
	props := &paho.PublishProperties{
		PayloadFormat: &pf, MessageExpiry: &exp, ContentType: "application/json",
		ResponseTopic: "reply/here", CorrelationData: []byte{1, 2, 3},
		User: paho.UserProperties{{Key: "a", Value: "1"}, {Key: "a", Value: "2"}, {Key: "b", Value: "x"}},
	}
	r := publish(t, pub, &paho.Publish{Topic: "props/x", QoS: 1, Payload: []byte(`{"v":1}`), Properties: props})
	if r.ReasonCode != 0 {
		t.Fatalf("puback reason %#x", r.ReasonCode)
	}
	p := receive(t, got, 5*time.Second)
	if p.Topic != "props/x" || string(p.Payload) != `{"v":1}` || p.QoS != 1 {
		t.Fatalf("got %s %q qos %d", p.Topic, p.Payload, p.QoS)
	}
	gp := p.Properties
	if gp.PayloadFormat == nil || *gp.PayloadFormat != 1 || gp.MessageExpiry == nil || *gp.MessageExpiry == 0 || *gp.MessageExpiry > 3600 ||
		gp.ContentType != "application/json" || gp.ResponseTopic != "reply/here" || !bytes.Equal(gp.CorrelationData, []byte{1, 2, 3}) {
		t.Fatalf("properties lost: %+v", gp)
	}
	if fmt.Sprint(gp.User) != fmt.Sprint(props.User) {
		t.Fatalf("user properties %v, want %v", gp.User, props.User)
	}
	recs := logRecords(t, d)
	if len(recs) != 1 {
		t.Fatalf("log holds %d records, want 1", len(recs))
	}
	rec := recs[0]
	if rec.ClientID != "pub" || rec.Topic != "props/x" || rec.QoS != 1 || rec.Props.ContentType != "application/json" || len(rec.Props.User) != 3 || !rec.Props.MessageExpirySet {
		t.Fatalf("record %+v", rec)
	}
}

func TestPipelinedPublishesAllAckedInLog(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	pub, _ := v5(t, d.MQTTAddr(), "pipe", nil)
	const n, workers = 600, 30
	var acked atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; i < n; i += workers {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				r, err := pub.Publish(ctx, &paho.Publish{Topic: "pipe/t", QoS: byte(1 + i%2), Payload: []byte(fmt.Sprint(i))})
				cancel()
				if err != nil || r.ReasonCode != 0 {
					errs <- fmt.Errorf("publish %d: %v %v", i, err, r)
					return
				}
				acked.Add(1)
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	recs := logRecords(t, d)
	seen := map[string]int{}
	for _, r := range recs {
		seen[string(r.Payload)]++
	}
	for i := 0; i < n; i++ {
		if seen[fmt.Sprint(i)] != 1 {
			t.Fatalf("payload %d is in the log %d times", i, seen[fmt.Sprint(i)])
		}
	}
}

func TestSyncTopicOnLoneGatewayRefusedAfterTimeout(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		c.Cluster.SyncTimeout = config.Duration(300 * time.Millisecond)
		c.Topics = []config.TopicRule{{Match: "s/#", Ack: "sync"}}
	})
	pub, _ := v5(t, d.MQTTAddr(), "syncpub", nil)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, _ := pub.Publish(ctx, &paho.Publish{Topic: "s/1", QoS: 1, Payload: []byte("x")})
	if r == nil || r.ReasonCode != 0x80 {
		t.Fatalf("sync publish on a lone gateway: %+v, want PUBACK 0x80", r)
	}
	if el := time.Since(start); el < 300*time.Millisecond {
		t.Fatalf("refused after %v, before sync_timeout", el)
	}
	// The connection still serves async topics.
	if r := publish(t, pub, &paho.Publish{Topic: "a/1", QoS: 1, Payload: []byte("y")}); r.ReasonCode != 0 {
		t.Fatalf("async after a refused sync: reason %#x", r.ReasonCode)
	}
	// QoS 2 gets the refusal on its PUBREC.
	r, _ = pub.Publish(ctx, &paho.Publish{Topic: "s/2", QoS: 2, Payload: []byte("z")})
	if r == nil || r.ReasonCode != 0x80 {
		t.Fatalf("QoS 2 sync publish on a lone gateway: %+v, want PUBREC 0x80", r)
	}
}

// rawConn is a minimal MQTT 3.1.1 client for what paho does not let a test
// do: send malformed bytes, watch for a disconnect.
type rawConn struct {
	t *testing.T
	net.Conn
}

func dialRaw(t *testing.T, addr, id string, clean bool) *rawConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	rc := &rawConn{t, c}
	flags := byte(0)
	if clean {
		flags = 2
	}
	var vh []byte
	vh = append(vh, 0, 4, 'M', 'Q', 'T', 'T', 4, flags, 0, 60)
	vh = append(vh, byte(len(id)>>8), byte(len(id)))
	vh = append(vh, id...)
	rc.send(0x10, vh)
	typ, body := rc.read()
	if typ != 0x20 || len(body) != 2 || body[1] != 0 {
		t.Fatalf("connack %#x %v", typ, body)
	}
	return rc
}

func (c *rawConn) send(hdr byte, body []byte) {
	if _, err := c.Write(testutil.MQTTFrame(hdr, body)); err != nil {
		c.t.Fatal(err)
	}
}

// read returns the next packet's first byte and body; typ 0 once the
// server has closed the connection.
func (c *rawConn) read() (byte, []byte) {
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	typ, body, err := testutil.ReadMQTTFrame(c)
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || isReset(err):
		return 0, nil
	case err != nil:
		c.t.Fatal(err)
	}
	return typ, body
}

func isReset(err error) bool {
	var ne *net.OpError
	return errors.As(err, &ne) && !ne.Timeout()
}

func (c *rawConn) publish(topic string, qos byte, pid uint16, payload string) {
	body := []byte{byte(len(topic) >> 8), byte(len(topic))}
	body = append(body, topic...)
	if qos > 0 {
		body = append(body, byte(pid>>8), byte(pid))
	}
	body = append(body, payload...)
	c.send(0x30|qos<<1, body)
}

func TestSyncTopicOnLoneGatewayDisconnectsMQTT311(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		c.Cluster.SyncTimeout = config.Duration(200 * time.Millisecond)
		c.Topics = []config.TopicRule{{Match: "s/#", Ack: "sync"}}
	})
	c := dialRaw(t, d.MQTTAddr(), "v3sync", true)
	c.publish("s/1", 1, 1, "x")
	if typ, body := c.read(); typ != 0 {
		t.Fatalf("3.1.1 client got packet %#x %v instead of a disconnect", typ, body)
	}
}

func TestMalformedAndOversizePacketsDropOnlyTheirClient(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	good, got := v5(t, d.MQTTAddr(), "good", nil)
	subscribe(t, good, "ok/#", 1)

	bad := dialRaw(t, d.MQTTAddr(), "bad", true)
	bad.Write([]byte{0x30 | 6, 0x05, 0xff, 0xff, 1, 2, 3}) // QoS 3 and a topic longer than the packet
	if typ, _ := bad.read(); typ != 0 {
		t.Fatalf("malformed packet answered with %#x, want a closed connection", typ)
	}

	big := dialRaw(t, d.MQTTAddr(), "big", true)
	// Over the 1 MiB default limit: the header alone makes the gateway hang
	// up, so the rest of the write may fail.
	big.Write([]byte{0x32, 0x80, 0x80, 0x80, 0x01, 0, 1, 'x', 0, 1})
	if typ, _ := big.read(); typ != 0 {
		t.Fatalf("oversize packet answered with %#x, want a closed connection", typ)
	}

	publish(t, good, &paho.Publish{Topic: "ok/1", QoS: 1, Payload: []byte("still here")})
	if p := receive(t, got, 5*time.Second); string(p.Payload) != "still here" {
		t.Fatalf("got %q", p.Payload)
	}
	for _, r := range logRecords(t, d) {
		if r.ClientID != "good" {
			t.Fatalf("a bad client's packet reached the log: %+v", r)
		}
	}
}

func TestQoS2FlowLogsOnce(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	pub, _ := v5(t, d.MQTTAddr(), "q2", nil)
	for i := 0; i < 20; i++ {
		if r := publish(t, pub, &paho.Publish{Topic: "q2/t", QoS: 2, Payload: []byte(fmt.Sprint(i))}); r.ReasonCode != 0 {
			t.Fatalf("pubcomp reason %#x", r.ReasonCode)
		}
	}
	if n := len(logRecords(t, d)); n != 20 {
		t.Fatalf("log holds %d records, want 20", n)
	}
}

func TestWillIsLoggedAndDelivered(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	sub, got := v5(t, d.MQTTAddr(), "watcher", nil)
	subscribe(t, sub, "wills/#", 1)
	willer, _ := v5(t, d.MQTTAddr(), "willer", &paho.Connect{CleanStart: true, WillMessage: &paho.WillMessage{Topic: "wills/willer", QoS: 1, Payload: []byte("gone")}})
	willer.TerminateConnectionForTest() // no DISCONNECT: the will must fire
	p := receive(t, got, 5*time.Second)
	if p.Topic != "wills/willer" || string(p.Payload) != "gone" {
		t.Fatalf("got %s %q", p.Topic, p.Payload)
	}
	// Deliveries follow log order: a second copy of the will would arrive
	// before a marker published after it.
	marker, _ := v5(t, d.MQTTAddr(), "marker", nil)
	publish(t, marker, &paho.Publish{Topic: "wills/marker", QoS: 1, Payload: []byte("m")})
	if p := receive(t, got, 5*time.Second); p.Topic != "wills/marker" {
		t.Fatalf("will delivered twice: %s %q", p.Topic, p.Payload)
	}
	var wills int
	for _, r := range logRecords(t, d) {
		if r.Will && r.Topic == "wills/willer" && r.ClientID == "willer" {
			wills++
		}
	}
	if wills != 1 {
		t.Fatalf("will logged %d times, want once", wills)
	}
}

func TestRetainedAndPersistentSubscriptionsSurviveRestart(t *testing.T) {
	dir := t.TempDir()
	d := testGateway(t, dir, nil)
	expiry := uint32(3600)
	ps, _ := v5(t, d.MQTTAddr(), "persistent", &paho.Connect{CleanStart: true, Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}})
	subscribe(t, ps, "persist/#", 1)
	ps.Disconnect(&paho.Disconnect{})
	pub, _ := v5(t, d.MQTTAddr(), "retainer", nil)
	publish(t, pub, &paho.Publish{Topic: "retained/1", QoS: 1, Retain: true, Payload: []byte("kept")})
	publish(t, pub, &paho.Publish{Topic: "persist/while-away", QoS: 1, Payload: []byte("queued")})
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}

	d2 := testGateway(t, dir, nil)
	late, got := v5(t, d2.MQTTAddr(), "late", nil)
	subscribe(t, late, "retained/#", 1)
	if p := receive(t, got, 5*time.Second); p.Topic != "retained/1" || string(p.Payload) != "kept" || !p.Retain {
		t.Fatalf("retained after restart: %s %q retain=%v", p.Topic, p.Payload, p.Retain)
	}
	c, back, ca := resume(t, d2.MQTTAddr(), "persistent", expiry)
	if !ca.SessionPresent {
		t.Fatal("reconnect: session not present")
	}
	defer c.Disconnect(&paho.Disconnect{})
	publish(t, pub2(t, d2), &paho.Publish{Topic: "persist/after", QoS: 1, Payload: []byte("fresh")})
	seen := map[string]bool{}
	for len(seen) < 2 {
		p := receive(t, back, 5*time.Second)
		seen[string(p.Payload)] = true
	}
	if !seen["queued"] || !seen["fresh"] {
		t.Fatalf("persistent session got %v, want queued and fresh", seen)
	}
}

func pub2(t *testing.T, d *Daemon) *paho.Client {
	c, _ := v5(t, d.MQTTAddr(), "pub2", nil)
	return c
}

type pbEntry = raftpb.Entry

func TestStatusOfALoneGateway(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) { c.Node.Name = "gw-1" })
	pub, _ := v5(t, d.MQTTAddr(), "st", nil)
	publish(t, pub, &paho.Publish{Topic: "s/t", QoS: 1, Payload: []byte("x")})
	resp, err := http.Get("http://" + d.HTTPAddr() + "/v1/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var s admin.Status
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		t.Fatal(err)
	}
	if s.Role != "master" || s.Node.Name != "gw-1" || len(s.Node.ID) != 16 || s.Leader == nil || s.Leader.Name != "gw-1" ||
		s.Members == nil || len(s.Members) != 0 || s.Log.LastIndex < 3 || s.Log.CommitIndex < s.Log.LastIndex-1 ||
		s.Disk.UsedBytes <= 0 || s.Disk.FreeBytes == 0 || s.MQTT.Clients != 1 || s.Pairing.Open {
		t.Fatalf("status of a lone gateway: %+v", s)
	}
}

// resume connects client id to addr as a device with a persistent session
// does (clean start off, the session expiry given) and returns the client,
// its received publishes and the CONNACK.
func resume(t *testing.T, addr, id string, expiry uint32) (*paho.Client, chan *paho.Publish, *paho.Connack) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *paho.Publish, 64)
	c := paho.NewClient(paho.ClientConfig{ClientID: id, Conn: conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			got <- pr.Packet
			return true, nil
		}}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, &paho.Connect{ClientID: id, CleanStart: false, KeepAlive: 30,
		Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}})
	if err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect %s to %s: %v %+v", id, addr, err, ca)
	}
	return c, got, ca
}
