package mqtt

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/eclipse/paho.golang/paho"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Every disconnect reaches the client (DESIGN.md, The MQTT layer): a
// connection the server ends with a reason code is sent its DISCONNECT,
// then the end of the stream (TCP: FIN; WebSocket: a close frame), and
// only then closed, even while the client keeps sending: a close over
// unread input is a reset, and a reset makes the client's stack throw
// away the DISCONNECT it has not read yet (the paho suite's
// test_flow_control2 got ConnectionResetError instead of 0x93).

// dialWS opens an MQTT-over-WebSocket connection to addr as a raw client.
func dialWS(t *testing.T, addr string, v byte) *raw {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	wc, _, err := websocket.Dial(ctx, "ws://"+addr+"/mqtt", &websocket.DialOptions{Subprotocols: []string{"mqtt"}})
	if err != nil {
		t.Fatal(err)
	}
	wc.SetReadLimit(4 << 20)
	c := websocket.NetConn(context.Background(), wc, websocket.MessageBinary)
	t.Cleanup(func() { wc.CloseNow() })
	return &raw{t: t, c: c, v: v, rd: &bytesReader{c}}
}

// flood has r's client send frame over and over, each in one write, until
// the connection fails; the returned func stops it and waits.
func flood(r *raw, frame []byte) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			if _, err := r.c.Write(frame); err != nil {
				return
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}

// readToEnd reads packets until the connection ends; it returns the
// DISCONNECT that came, if one did, and the error the stream ended with.
func readToEnd(r *raw) (d packets.Packet, ok bool, end error) {
	for {
		pk, err := r.read(5 * time.Second)
		if err != nil {
			return d, ok, err
		}
		if pk.FixedHeader.Type == packets.Disconnect {
			d, ok = pk, true
		}
	}
}

func encoded(t *testing.T, pk packets.Packet) []byte {
	t.Helper()
	pk.ProtocolVersion = 5
	var b bytes.Buffer
	if err := pk.PublishEncode(&b); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// [MQTT-3.14.4-2]: the server closes the connection after its DISCONNECT,
// and a client that keeps sending when the server ends its connection still
// reads the reason code, over TCP and over WebSocket: 0x93 receive maximum
// exceeded, 0x97 quota exceeded (its queue is full), 0x9C use another
// server with its Server Reference, 0x8E session taken over, 0x8B server
// shutting down. Over WebSocket the DISCONNECT was lost to an abrupt
// close: the library closes the connection when a read deadline passes
// during a read, which is how the server stops a connection's read loop.
func TestMQTT_3_14_4_2_DisconnectReachesAClientThatKeepsSending(t *testing.T) {
	const ref = "198.51.100.2:1883"
	qos0 := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: "flood/x", Payload: bytes.Repeat([]byte("f"), 512)}
	cases := []struct {
		name   string
		code   packets.Code
		mutate func(*Config)
		// run connects the client, sets it sending and has the server
		// end it; the client is read afterwards.
		run func(t *testing.T, s *Server, log *memLog, dial func() *raw) (*raw, func())
	}{
		{"0x93 receive maximum", packets.ErrReceiveMaximum, func(c *Config) { c.MaxInflight = 4 },
			func(t *testing.T, s *Server, log *memLog, dial func() *raw) (*raw, func()) {
				c := dial()
				c.connect("burst", true, nil)
				// QoS 1 publishes whose acks stay owed, past the window
				// and on.
				pk := qos0
				pk.FixedHeader.Qos, pk.PacketID = 1, 1
				return c, flood(c, encoded(t, pk))
			}},
		{"0x97 queue full", packets.ErrQuotaExceeded, func(c *Config) { c.MaxQueued = 4; c.DisconnectWhenQueueFull = true },
			func(t *testing.T, s *Server, log *memLog, dial func() *raw) (*raw, func()) {
				c := dial()
				c.connect("laggard", true, &packets.Properties{ReceiveMaximum: 1})
				c.subscribe(1, packets.Subscription{Filter: "q/#", Qos: 1})
				stop := flood(c, encoded(t, qos0))
				pub := dialRaw(t, s.Addr(), 5)
				pub.connect("pub", true, nil)
				for i := 0; i < 20; i++ {
					pub.publish("q/x", 1, uint16(i+1), fmt.Sprint(i))
					pub.expect(packets.Puback)
				}
				return c, stop
			}},
		{"0x9C use another server", packets.ErrUseAnotherServer, nil,
			func(t *testing.T, s *Server, log *memLog, dial func() *raw) (*raw, func()) {
				c := dial()
				c.connect("moved", true, nil)
				stop := flood(c, encoded(t, qos0))
				s.Redirect(ref, "")
				return c, stop
			}},
		{"0x8E taken over", packets.ErrSessionTakenOver, nil,
			func(t *testing.T, s *Server, log *memLog, dial func() *raw) (*raw, func()) {
				c := dial()
				c.connect("twin", true, nil)
				stop := flood(c, encoded(t, qos0))
				dialRaw(t, s.Addr(), 5).connect("twin", true, nil)
				return c, stop
			}},
		{"0x8B shutting down", packets.ErrServerShuttingDown, nil,
			func(t *testing.T, s *Server, log *memLog, dial func() *raw) (*raw, func()) {
				c := dial()
				c.connect("stayer", true, nil)
				stop := flood(c, encoded(t, qos0))
				go log.halt()
				return c, stop
			}},
	}
	for _, transport := range []string{"tcp", "ws"} {
		for _, tc := range cases {
			t.Run(transport+"/"+tc.name, func(t *testing.T) {
				log := newMemLog()
				if tc.code == packets.ErrReceiveMaximum {
					log.hold = make(chan struct{}) // the acks stay owed
					defer close(log.hold)
				}
				s, _ := testServer(t, log, func(c *Config) {
					c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0"}
					if tc.mutate != nil {
						tc.mutate(c)
					}
				})
				dial := func() *raw { return dialRaw(t, s.Addr(), 5) }
				if transport == "ws" {
					dial = func() *raw { return dialWS(t, s.WSAddr(), 5) }
				}
				c, stop := tc.run(t, s, log, dial)
				d, ok, end := readToEnd(c)
				stop()
				if !ok || d.ReasonCode != tc.code.Code {
					t.Fatalf("the client read DISCONNECT %v %#x, then %v; want %#x", ok, d.ReasonCode, end, tc.code.Code)
				}
				if tc.code == packets.ErrUseAnotherServer && d.Properties.ServerReference != ref {
					t.Fatalf("DISCONNECT 0x9C names %q, want %q", d.Properties.ServerReference, ref)
				}
				// The end of the stream, not a reset: TCP's FIN, the
				// WebSocket's close frame (io.EOF from NetConn).
				if !errors.Is(end, io.EOF) {
					t.Errorf("after the DISCONNECT the stream ended with %v, want its end", end)
				}
			})
		}
	}
}

// paho.golang, publishing over WebSocket as the gateway stops, is told
// 0x8B through OnServerDisconnect (a dashboard saw it in 1 of 3 restarts).
func TestPahoOverWebSocketIsToldTheServerShutsDown(t *testing.T) {
	s, log := testServer(t, nil, func(c *Config) { c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0"} })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	wc, _, err := websocket.Dial(ctx, "ws://"+s.WSAddr()+"/mqtt", &websocket.DialOptions{Subprotocols: []string{"mqtt"}})
	if err != nil {
		t.Fatal(err)
	}
	defer wc.CloseNow()
	told := make(chan *paho.Disconnect, 1)
	pc := paho.NewClient(paho.ClientConfig{ClientID: "dash", Conn: &lockedConn{Conn: websocket.NetConn(context.Background(), wc, websocket.MessageBinary)},
		OnServerDisconnect: func(d *paho.Disconnect) { told <- d }})
	if ca, err := pc.Connect(ctx, &paho.Connect{ClientID: "dash", CleanStart: true, KeepAlive: 30}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect: %v %+v", err, ca)
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			select {
			case <-done:
				return
			default:
			}
			if _, err := pc.Publish(ctx, &paho.Publish{Topic: "dash/x", Payload: []byte("p")}); err != nil {
				return
			}
		}
	}()
	go log.halt()
	select {
	case d := <-told:
		if d.ReasonCode != packets.ErrServerShuttingDown.Code {
			t.Fatalf("told DISCONNECT %#x, want 0x8B", d.ReasonCode)
		}
	case <-ctx.Done():
		t.Fatal("paho.golang was not told the server shuts down")
	}
}

// [MQTT-3.1.4-3]: a client taking over a session gets its CONNACK while
// the old connection still drains (DISCONNECT 0x8E sent, its client
// silent: a device's half-open connection), not after that up to 500 ms:
// the paho 3.1.1 suite gives a CONNACK 0.5 s and timed out.
func TestMQTT_3_1_4_3_TakeOverDoesNotWaitForTheOldSocketsDrain(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	old := dialRaw(t, s.Addr(), 5)
	old.connect("device", true, nil)
	again := dialRaw(t, s.Addr(), 5)
	again.connect("device", true, nil)
	if n := s.openConns.Load(); n != 2 {
		t.Fatalf("%d sockets open at the new CONNACK, want 2: the old one was closed (drained) first", n)
	}
	if code, ok := old.closed(); !ok || code != packets.ErrSessionTakenOver.Code {
		t.Fatalf("the old connection: DISCONNECT %v %#x, want 0x8E", ok, code)
	}
	again.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	again.expect(packets.Pingresp)
}

// [MQTT-3.1.2-22]: a client silent past one and a half times its keep
// alive is disconnected, over WebSocket too, and an MQTT 5 one is told
// 0x8D. The keep-alive deadline closed the WebSocket with nothing said.
func TestMQTT_3_1_2_22_KeepAliveTimeoutReachesAWebSocketClient(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0"} })
	c := dialWS(t, s.WSAddr(), 5)
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "sleepy", Clean: true, Keepalive: 1}}
	c.write(pk)
	c.expect(packets.Connack)
	d, ok, end := readToEnd(c)
	if !ok || d.ReasonCode != packets.ErrKeepAliveTimeout.Code || !errors.Is(end, io.EOF) {
		t.Fatalf("a silent client: DISCONNECT %v %#x, then %v; want 0x8D and the stream's end", ok, d.ReasonCode, end)
	}
}

// [MQTT-3.1.2-22]: the keep-alive deadline, moved only when it falls
// short (deadlineSlack), still follows a client that keeps sending: one
// sending a PINGREQ every 200 ms for twice its 1.5 s is not cut off, and
// once silent it is disconnected (0x8D) no sooner than 1.5 s after its
// last packet and not much later.
func TestMQTT_3_1_2_22_KeepAliveFollowsABusyClient(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "busy", Clean: true, Keepalive: 1}})
	if ack, err := c.read(5 * time.Second); err != nil || ack.FixedHeader.Type != packets.Connack || ack.ReasonCode != 0 {
		t.Fatalf("no CONNACK: %v %+v", err, ack)
	}
	var last time.Time
	for start := time.Now(); time.Since(start) < 3*time.Second; {
		time.Sleep(200 * time.Millisecond) // the client's pace: time passing is what is tested
		last = time.Now()
		c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
		if pk, err := c.read(5 * time.Second); err != nil || pk.FixedHeader.Type != packets.Pingresp {
			t.Fatalf("%v after the CONNECT: %v %+v, want a PINGRESP", time.Since(start), err, pk.FixedHeader)
		}
	}
	d, ok, end := readToEnd(c)
	silent := time.Since(last)
	if !ok || d.ReasonCode != packets.ErrKeepAliveTimeout.Code || !errors.Is(end, io.EOF) {
		t.Fatalf("a silent client: DISCONNECT %v %#x, then %v; want 0x8D and the stream's end", ok, d.ReasonCode, end)
	}
	if silent < 1500*time.Millisecond || silent > 3*time.Second {
		t.Fatalf("disconnected %v after its last packet, want 1.5 s (and up to 1/16 of that more)", silent)
	}
	other := dialRaw(t, s.Addr(), 5)
	other.connect("after", true, nil)
}
