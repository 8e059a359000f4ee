package mqtt

import (
	"context"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/eclipse/paho.golang/paho"
)

// MQTT over WebSocket: a browser-style client (subprotocol "mqtt") gets
// the same broker as TCP clients; a page of another origin is refused.
func TestWebSocketListener(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.WebSocket = &WebSocketConfig{Listen: "127.0.0.1:0"} })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	wc, _, err := websocket.Dial(ctx, "ws://"+s.WSAddr()+"/mqtt", &websocket.DialOptions{Subprotocols: []string{"mqtt"}})
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *paho.Publish, 8)
	c := paho.NewClient(paho.ClientConfig{ClientID: "browser", Conn: &lockedConn{Conn: websocket.NetConn(context.Background(), wc, websocket.MessageBinary)},
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			got <- pr.Packet
			return true, nil
		}}})
	if ca, err := c.Connect(ctx, &paho.Connect{ClientID: "browser", CleanStart: true, KeepAlive: 30}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect over websocket: %v %+v", err, ca)
	}
	defer c.Disconnect(&paho.Disconnect{})
	if _, err := c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "dash/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	tcp, _ := pahoClient(t, s.Addr(), "device", nil)
	if _, err := tcp.Publish(ctx, &paho.Publish{Topic: "dash/t", QoS: 1, Payload: []byte("21.5")}); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-got:
		if string(p.Payload) != "21.5" {
			t.Fatalf("got %q", p.Payload)
		}
	case <-ctx.Done():
		t.Fatal("nothing over the websocket")
	}
	if _, err := c.Publish(ctx, &paho.Publish{Topic: "dash/cmd", QoS: 1, Payload: []byte("on")}); err != nil {
		t.Fatalf("publish over websocket: %v", err)
	}
	_, resp, err := websocket.Dial(ctx, "ws://"+s.WSAddr()+"/mqtt", &websocket.DialOptions{Subprotocols: []string{"mqtt"},
		HTTPHeader: http.Header{"Origin": {"http://evil.example"}}})
	if err == nil || resp == nil || resp.StatusCode != http.StatusForbidden {
		t.Fatalf("a cross-origin page: %v %v, want 403", err, resp)
	}
}

// lockedConn lets paho.golang write each packet whole: it writes a packet
// as several Writes (net.Buffers), locking the connection only when it is
// a sync.Locker, and over WebSocket each Write is a message of its own, so
// two goroutines' packets would interleave.
type lockedConn struct {
	net.Conn
	sync.Mutex
}
