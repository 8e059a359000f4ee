package daemon

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	pahomqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// The reproduction with the real client: mosquitto_sub over MQTT
// 5 at QoS 1 (its Receive Maximum is 20) takes every message of a
// pipelined publisher, and the gateway still answers.
func TestMosquittoSubV5QoS1TakesEveryMessage(t *testing.T) {
	testutil.NeedTool(t, "mosquitto_sub")
	d := testGateway(t, t.TempDir(), nil)
	host, port := splitAddr(t, d.MQTTAddr())
	const n = 5000
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	sub := exec.CommandContext(ctx, "mosquitto_sub", "-V", "mqttv5", "-h", host, "-p", port, "-t", "bench/#", "-q", "1", "-C", fmt.Sprint(n), "-i", "mosq-sub", "-F", "%t") // the topic, one line each: payloads are binary
	sub.Stdout = &out
	if err := sub.Start(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "mosquitto_sub to subscribe", func() bool { return !d.broker.Unrouted([]byte("bench/x")) })
	pub, _ := v5(t, d.MQTTAddr(), "pub", nil)
	if err := pipelinedPublisher(pub, "bench/x", 1, 64, 0, n); err != nil {
		t.Fatal(err)
	}
	if err := sub.Wait(); err != nil {
		t.Fatalf("mosquitto_sub: %v after %d lines", err, strings.Count(out.String(), "\n"))
	}
	if got := strings.Count(out.String(), "\n"); got != n {
		t.Fatalf("mosquitto_sub printed %d messages, want %d", got, n)
	}
	assertAnswersAndStops(t, d)
}

// A 3.1.1 persistent session (mosquitto_sub -c) coming back while messages
// wait for it gets them, and a new SUBSCRIBE is granted although its
// packet id is one the server used for a delivery (the mochi-based layer
// answered 0x91, not even a 3.1.1 code).
func TestMosquittoPersistentSessionResumes(t *testing.T) {
	testutil.NeedTool(t, "mosquitto_sub")
	testutil.NeedTool(t, "mosquitto_pub")
	d := testGateway(t, t.TempDir(), nil)
	host, port := splitAddr(t, d.MQTTAddr())
	run := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, args[0], append([]string{"-h", host, "-p", port}, args[1:]...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	// Subscribe once (persistent), leave at once.
	run("mosquitto_sub", "-V", "mqttv311", "-c", "-i", "pz1", "-q", "1", "-t", "pz/#", "-E")
	for i := 0; i < 3; i++ {
		run("mosquitto_pub", "-V", "mqttv311", "-q", "1", "-t", "pz/a", "-m", fmt.Sprint("queued-", i))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out bytes.Buffer
	back := exec.CommandContext(ctx, "mosquitto_sub", "-h", host, "-p", port, "-V", "mqttv311", "-c", "-i", "pz1", "-q", "1",
		"-t", "pz/#", "-t", "pz2/#", "-C", "4", "-W", "20")
	back.Stdout, back.Stderr = &out, &out
	if err := back.Start(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the new filter to take effect", func() bool { return !d.broker.Unrouted([]byte("pz2/x")) })
	run("mosquitto_pub", "-V", "mqttv311", "-q", "1", "-t", "pz2/x", "-m", "new-filter")
	if err := back.Wait(); err != nil {
		t.Fatalf("mosquitto_sub: %v\n%s", err, out.String())
	}
	if want := "queued-0\nqueued-1\nqueued-2\nnew-filter\n"; out.String() != want {
		t.Fatalf("the resumed session printed %q, want %q", out.String(), want)
	}
}

// The 3.1.1 client of paho.mqtt.golang: a persistent session resumes with
// the QoS 1 messages published while it was away.
func TestPahoMQTT311PersistentSession(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	got := make(chan string, 16)
	opts := pahomqtt.NewClientOptions().AddBroker("tcp://" + d.MQTTAddr()).SetClientID("p311").
		SetCleanSession(false).SetProtocolVersion(4).SetAutoReconnect(false)
	opts.SetDefaultPublishHandler(func(_ pahomqtt.Client, m pahomqtt.Message) { got <- string(m.Payload()) })
	c := pahomqtt.NewClient(opts)
	if tok := c.Connect(); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("connect: %v", tok.Error())
	}
	if tok := c.Subscribe("p311/#", 1, nil); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("subscribe: %v", tok.Error())
	}
	c.Disconnect(100)
	pub, _ := v5(t, d.MQTTAddr(), "p311-pub", nil)
	for i := 0; i < 3; i++ {
		publish(t, pub, &paho.Publish{Topic: "p311/x", QoS: 1, Payload: []byte(fmt.Sprint("m", i))})
	}
	c = pahomqtt.NewClient(opts)
	if tok := c.Connect(); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("reconnect: %v", tok.Error())
	}
	defer c.Disconnect(100)
	for i := 0; i < 3; i++ {
		select {
		case m := <-got:
			if m != fmt.Sprint("m", i) {
				t.Fatalf("message %d: %q", i, m)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("message %d did not come", i)
		}
	}
}

// splitAddr splits host:port.
func splitAddr(t *testing.T, a string) (string, string) {
	t.Helper()
	i := strings.LastIndex(a, ":")
	return a[:i], a[i+1:]
}

// A device refused by the connect rate limit is told why (CONNACK 0x9F
// connection rate exceeded; 3.1.1: 0x03 server unavailable), so
// mosquitto_pub run in a loop says so instead of "The connection was
// lost", and every run either publishes or says it was refused.
func TestMosquittoPubInALoopIsToldTheConnectRate(t *testing.T) {
	testutil.NeedTool(t, "mosquitto_pub")
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		c.MQTT.ConnectRate = 0.01 // no token comes back during the test
		c.MQTT.ConnectBurst = 4
	})
	host, port := splitAddr(t, d.MQTTAddr())
	for _, v := range []struct{ flag, told string }{{"mqttv5", "connection rate exceeded"}, {"mqttv311", "unavailable"}} {
		published, told := 0, 0
		for i := 0; i < 6; i++ {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			out, err := exec.CommandContext(ctx, "mosquitto_pub", "-h", host, "-p", port, "-V", v.flag, "-q", "1", "-t", "loop/x", "-m", fmt.Sprint(i)).CombinedOutput()
			cancel()
			switch low := strings.ToLower(string(out)); {
			case err == nil:
				published++
			case strings.Contains(low, v.told):
				told++
			default:
				t.Fatalf("mosquitto_pub -V %s run %d: %v, not told why:\n%s", v.flag, i, err, out)
			}
		}
		t.Logf("%s: %d published, %d told %q", v.flag, published, told, v.told)
		if told == 0 {
			t.Fatalf("%s: no run was refused: the rate limit did not apply", v.flag)
		}
	}
	// 127.0.0.1 is over the rate: another source checks that the gateway
	// still serves, then it stops.
	c, ca := mqttOn(t, dialFrom(t, "127.0.0.2", d.MQTTAddr()), connOpts{version: 5, id: "after-the-loop"})
	if ca.closed || ca.code != 0 {
		t.Fatalf("a client from another address: %+v", ca)
	}
	c.pub("loop/after", 1, false, 1, nil, "x")
	if r := c.ack(0x40, 1); r != 0 {
		t.Fatalf("publish from another address: PUBACK %#x", r)
	}
	stopped := make(chan struct{})
	go func() {
		d.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("the gateway did not stop within 5 s")
	}
}
