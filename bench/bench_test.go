package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	packets5 "github.com/eclipse/paho.golang/packets"
	packets3 "github.com/eclipse/paho.mqtt.golang/packets"

	"github.com/tandem-edge/tandem/internal/cloudtest"
)

// mosquitto is a Mosquitto broker on a loopback port, started for one test.
type mosquitto struct {
	addr string
	cmd  *exec.Cmd
}

// startMosquitto starts Mosquitto (in memory) on a free loopback port and
// returns once its log says it runs, which it prints after opening its
// listeners. Tests that need it are skipped where it is not installed
// (apt-get install mosquitto).
func startMosquitto(t *testing.T) *mosquitto {
	t.Helper()
	bin := cloudtest.Mosquitto(t) // skips, naming the package, where it is not installed
	for attempt := 0; ; attempt++ {
		m, err := tryMosquitto(t, bin)
		if err == nil {
			return m
		}
		if attempt == 2 {
			t.Fatal(err)
		}
		t.Logf("mosquitto did not start (%v); again on another port", err)
	}
}

func tryMosquitto(t *testing.T, bin string) (*mosquitto, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	_, port, _ := net.SplitHostPort(addr)
	conf := filepath.Join(t.TempDir(), "mosquitto.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf("listener %s 127.0.0.1\nallow_anonymous true\npersistence false\n"+
		"max_queued_messages 100000\nconnection_messages false\nlog_dest stderr\nlog_type error\nlog_type warning\nlog_type information\n", port)), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-c", conf)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	running := make(chan bool, 1)
	var log strings.Builder
	go func() {
		sc := bufio.NewScanner(stderr)
		sent := false
		for sc.Scan() {
			if !sent {
				log.WriteString(sc.Text() + "\n")
				if strings.Contains(sc.Text(), " running") {
					running <- true
					sent = true
				}
			}
		}
		if !sent {
			running <- false
		}
		_, _ = io.Copy(io.Discard, stderr)
	}()
	stop := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
	select {
	case ok := <-running:
		if ok {
			t.Cleanup(stop)
			return &mosquitto{addr: addr, cmd: cmd}, nil
		}
		stop()
		return nil, fmt.Errorf("mosquitto exited: %s", log.String())
	case <-time.After(15 * time.Second):
		stop()
		return nil, fmt.Errorf("mosquitto did not say it runs within 15 s")
	}
}

// sockets counts the sockets a process holds open.
func sockets(t *testing.T, pid int) int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Skipf("cannot count the broker's sockets: %v", err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasPrefix(l, "socket:") {
			n++
		}
	}
	return n
}

// Fan-out at QoS 1: every subscriber acks and receives every publish, over
// MQTT 5 with a small Receive Maximum (the broker may have only 5
// deliveries unacked per subscriber) and over 3.1.1.
func TestFanOutQoS1SubscribersReceiveEveryMessage(t *testing.T) {
	m := startMosquitto(t)
	for _, v := range []int{5, 3} {
		r, err := Run(context.Background(), Options{Broker: m.addr, Version: v, Clients: 2, Count: 300, Window: 8, QoS: 1, Size: 16,
			Topic: fmt.Sprintf("fan/%d/%%c", v), Subscribers: 3, SubscribeQoS: 1, SubscriberReceiveMax: 5})
		if err != nil {
			t.Fatalf("MQTT %d: %v", v, err)
		}
		if r.Acked != 600 || r.Failed != 0 || r.Subscribers != 3 || r.SubscribeQoS != 1 {
			t.Fatalf("MQTT %d: %+v", v, r)
		}
		if r.Received != 1800 || r.ReceivedMin != 600 || r.DeliveredQoS != 1 {
			t.Fatalf("MQTT %d: %d deliveries (fewest to one subscriber %d, up to QoS %d), want 3 × 600 at QoS 1", v, r.Received, r.ReceivedMin, r.DeliveredQoS)
		}
		if r.DeliveriesPerSec <= 0 || r.E2EP50Ms <= 0 || r.E2EP99Ms < r.E2EP50Ms {
			t.Fatalf("MQTT %d: %+v", v, r)
		}
	}
}

// The subscription's QoS decides the deliveries' QoS: lower than the
// publishes' it downgrades them; -1 follows the publishes.
func TestSubscribeQoS(t *testing.T) {
	m := startMosquitto(t)
	r, err := Run(context.Background(), Options{Broker: m.addr, Clients: 1, Count: 200, Window: 4, QoS: 1, Size: 8,
		Topic: "q0/%c", Subscribers: 1, SubscribeQoS: 0})
	if err != nil {
		t.Fatal(err)
	}
	if r.Acked != 200 || r.Received == 0 || r.DeliveredQoS != 0 || r.SubscribeQoS != 0 {
		t.Fatalf("QoS 0 subscription: %+v", r)
	}
	r, err = Run(context.Background(), Options{Broker: m.addr, Clients: 1, Count: 200, Window: 4, QoS: 2, Size: 8,
		Topic: "q2/%c", Subscribe: true, SubscribeQoS: -1, SubscriberReceiveMax: 3})
	if err != nil {
		t.Fatal(err)
	}
	if r.Acked != 200 || r.Subscribers != 1 || r.Received != 200 || r.DeliveredQoS != 2 || r.SubscribeQoS != 2 {
		t.Fatalf("QoS 2 subscription: %+v", r)
	}
}

// Idle connections are held by the broker until they are closed, with a
// DISCONNECT the broker answers by closing its side.
func TestIdleConnections(t *testing.T) {
	m := startMosquitto(t)
	pid := m.cmd.Process.Pid
	before := sockets(t, pid)
	ic, err := OpenIdle(context.Background(), Options{Broker: m.addr}, 300)
	if err != nil {
		t.Fatal(err)
	}
	// Every CONNACK is in, so the broker has accepted every connection.
	if n := sockets(t, pid); n != before+300 || ic.Open() != 300 {
		t.Fatalf("the broker holds %d sockets (%d before), %d open here; want 300 more", n, before, ic.Open())
	}
	ic.Close()
	if n := sockets(t, pid); n != before || ic.Open() != 0 {
		t.Fatalf("after Close the broker holds %d sockets (%d before), %d open here", n, before, ic.Open())
	}

	// Through Run, over 3.1.1, beside publishers.
	r, err := Run(context.Background(), Options{Broker: m.addr, Version: 3, Clients: 1, Count: 20, QoS: 1, Idle: 50})
	if err != nil {
		t.Fatal(err)
	}
	if r.Idle != 50 || r.IdleOpen != 50 || r.Acked != 20 || r.IdleConnectSeconds <= 0 {
		t.Fatalf("%+v", r)
	}
	// Only idle connections, held for a moment.
	r, err = Run(context.Background(), Options{Broker: m.addr, Clients: 0, Idle: 10, Duration: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if r.IdleOpen != 10 || r.Sent != 0 || r.Seconds < 0.05 {
		t.Fatalf("%+v", r)
	}
}

// The hand-written CONNECT decodes with the paho codecs of both versions.
func TestConnectPacketDecodes(t *testing.T) {
	p5, err := packets5.ReadPacket(bytes.NewReader(connectPacket(5, "id-5", "u", "pw", 60)))
	if err != nil {
		t.Fatal(err)
	}
	c5 := p5.Content.(*packets5.Connect)
	if c5.ProtocolVersion != 5 || c5.ClientID != "id-5" || !c5.CleanStart || c5.KeepAlive != 60 || c5.Username != "u" || string(c5.Password) != "pw" {
		t.Fatalf("MQTT 5: %s", c5)
	}
	p3, err := packets3.ReadPacket(bytes.NewReader(connectPacket(3, strings.Repeat("x", 200), "", "", 60)))
	if err != nil {
		t.Fatal(err)
	}
	c3 := p3.(*packets3.ConnectPacket)
	if c3.ProtocolVersion != 4 || c3.ProtocolName != "MQTT" || c3.ClientIdentifier != strings.Repeat("x", 200) || !c3.CleanSession || c3.UsernameFlag || c3.Keepalive != 60 {
		t.Fatalf("MQTT 3.1.1: %s", c3)
	}
}

// A refused CONNECT, or a connection closed before its CONNACK, is an
// error that says so, and leaves no connection open.
func TestIdleConnectRefused(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for i := 0; ; i++ {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if _, _, err := readPacket(c); err == nil && i%2 == 0 {
				_, _ = c.Write([]byte{0x20, 0x03, 0x00, 0x87, 0x00}) // CONNACK not authorized
			}
			c.Close()
		}
	}()
	_, err = OpenIdle(context.Background(), Options{Broker: l.Addr().String()}, 1)
	if err == nil || !strings.Contains(err.Error(), "reason 0x87") {
		t.Fatalf("refused: %v", err)
	}
	_, err = OpenIdle(context.Background(), Options{Broker: l.Addr().String()}, 1)
	if err == nil || !strings.Contains(err.Error(), "before its CONNACK") {
		t.Fatalf("closed: %v", err)
	}
}
