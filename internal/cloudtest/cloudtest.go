// Package cloudtest runs Debian's mosquitto as the cloud broker of an
// uplink test and records what arrives there. It imports no package of
// ours. Every process it starts is killed by its PID when the test ends,
// and each recorder's goroutines (paho's) are waited for.
package cloudtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
)

// Cloud is a mosquitto started by the test.
type Cloud struct {
	t    testing.TB
	Dir  string // its config, persistence and log
	Host string // the address it listens on
	Port int
	wrap func(name string, args ...string) *exec.Cmd
	dial func(addr string) (net.Conn, error)
	cmd  *exec.Cmd
	done chan struct{}
}

// Mosquitto finds the broker binary; without it the test skips (fails
// under CI=true: .ci/run installs it).
func Mosquitto(t testing.TB) string {
	t.Helper()
	if p, err := exec.LookPath("/usr/sbin/mosquitto"); err == nil {
		return p
	}
	if p, err := exec.LookPath("mosquitto"); err == nil {
		return p
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("mosquitto not installed (Debian package mosquitto)")
	}
	t.Skip("SKIPPED: mosquitto not installed (Debian package mosquitto)")
	return ""
}

// Start runs mosquitto listening on host:port (port 0: a free loopback
// port), anonymous, with persistence. wrap makes the command (nil:
// exec.Command); a namespace host's Command runs it there.
func Start(t testing.TB, host string, port int, wrap func(name string, args ...string) *exec.Cmd) *Cloud {
	t.Helper()
	return StartIn(t, host, port, wrap, nil)
}

// StartIn is Start with the dial that checks the broker takes connections
// (nil: from the test's own network namespace). A broker in another
// namespace must be dialled from there: from the test's namespace its
// address is not on any interface, and a host whose default route leads
// to a proxy answers the dial itself (seen in CI: the check passed, the
// recorder's dial a moment later was refused).
func StartIn(t testing.TB, host string, port int, wrap func(name string, args ...string) *exec.Cmd, dial func(addr string) (net.Conn, error)) *Cloud {
	t.Helper()
	bin := Mosquitto(t)
	if wrap == nil {
		wrap = exec.Command
	}
	if port == 0 {
		ln, err := net.Listen("tcp", host+":0")
		if err != nil {
			t.Fatal(err)
		}
		port = ln.Addr().(*net.TCPAddr).Port
		ln.Close()
	}
	if dial == nil {
		dial = func(addr string) (net.Conn, error) { return net.DialTimeout("tcp", addr, time.Second) }
	}
	c := &Cloud{t: t, Dir: t.TempDir(), Host: host, Port: port, wrap: wrap, dial: dial}
	conf := ""
	if os.Geteuid() == 0 {
		conf = "user root\n" // else it cannot write the test's directory
	}
	conf += fmt.Sprintf("persistence true\npersistence_location %s/\nmax_queued_messages 0\nmax_inflight_messages 0\n"+
		"log_dest file %s/mosquitto.log\nlistener %d %s\nallow_anonymous true\n", c.Dir, c.Dir, port, host)
	if err := os.WriteFile(filepath.Join(c.Dir, "mosquitto.conf"), []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	c.run(bin)
	t.Cleanup(func() {
		c.Kill()
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(c.Dir, "mosquitto.log"))
			t.Logf("mosquitto.log (tail):\n%s", b[max(0, len(b)-3000):])
		}
	})
	return c
}

// Addr is host:port.
func (c *Cloud) Addr() string { return net.JoinHostPort(c.Host, strconv.Itoa(c.Port)) }

// URL is the uplink broker address, tcp://host:port.
func (c *Cloud) URL() string { return "tcp://" + c.Addr() }

func (c *Cloud) run(bin string) {
	c.t.Helper()
	c.cmd = c.wrap(bin, "-c", filepath.Join(c.Dir, "mosquitto.conf"))
	if err := c.cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	c.done = make(chan struct{})
	cmd, done := c.cmd, c.done
	go func() { _ = cmd.Wait(); close(done) }()
	// Its log says it opens the socket a moment before the socket takes
	// connections (a dial in between was refused, under load): both.
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(c.Dir, "mosquitto.log"))
		if len(b) > 0 && containsListening(string(b)) {
			if nc, err := c.dial(c.Addr()); err == nil {
				nc.Close()
				return
			}
		}
		select {
		case <-done:
			c.t.Fatalf("mosquitto exited at start: %s", b)
		default:
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("mosquitto did not listen within 5s: %s", b)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func containsListening(log string) bool { return strings.Contains(log, "Opening ipv4 listen socket") }

// Kill stops the mosquitto this test started, by its PID (SIGKILL).
func (c *Cloud) Kill() {
	if c.cmd == nil {
		return
	}
	_ = c.cmd.Process.Kill()
	<-c.done
	c.cmd = nil
}

// Msg is one message as the recorder received it.
type Msg struct {
	Topic, Payload string
	ID             string // the tandem-id user property
}

// Received is p as a Msg, its tandem-id read.
func Received(p *paho.Publish) Msg {
	m := Msg{Topic: p.Topic, Payload: string(p.Payload)}
	if p.Properties != nil {
		m.ID = p.Properties.User.Get("tandem-id")
	}
	return m
}

// Recorder is a cloud subscriber that records what arrives, in order.
type Recorder struct {
	mu   sync.Mutex
	msgs []Msg
	cl   *paho.Client
}

// Record subscribes to filter at the cloud over the connection dial
// opens, at QoS 1, and records until the test ends.
func Record(t testing.TB, dial func() (net.Conn, error), filter string) *Recorder {
	t.Helper()
	conn, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	r := &Recorder{}
	r.cl = paho.NewClient(paho.ClientConfig{
		Conn: conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			m := Received(pr.Packet)
			r.mu.Lock()
			r.msgs = append(r.msgs, m)
			r.mu.Unlock()
			return true, nil
		}},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := r.cl.Connect(ctx, &paho.Connect{ClientID: "recorder", CleanStart: true, KeepAlive: 30}); err != nil {
		t.Fatalf("recorder connect: %v", err)
	}
	if _, err := r.cl.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: 1}}}); err != nil {
		t.Fatalf("recorder subscribe: %v", err)
	}
	t.Cleanup(func() {
		_ = r.cl.Disconnect(&paho.Disconnect{})
		<-r.cl.Done()
	})
	return r
}

// Msgs returns what arrived so far, in arrival order.
func (r *Recorder) Msgs() []Msg {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Msg(nil), r.msgs...)
}

// Distinct counts the different payloads that arrived (tests make them
// unique), and the duplicates.
func (r *Recorder) Distinct() (distinct, dups int) {
	seen := map[string]bool{}
	for _, m := range r.Msgs() {
		if seen[m.Payload] {
			dups++
		}
		seen[m.Payload] = true
	}
	return len(seen), dups
}

// Publish sends one message at the cloud over the connection dial opens,
// as a cloud application sending a command would.
func Publish(t testing.TB, dial func() (net.Conn, error), topic, payload string) {
	t.Helper()
	conn, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	cl := paho.NewClient(paho.ClientConfig{Conn: conn})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := cl.Connect(ctx, &paho.Connect{ClientID: "cloud-app", CleanStart: true, KeepAlive: 5}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(payload)}); err != nil {
		t.Fatal(err)
	}
	_ = cl.Disconnect(&paho.Disconnect{})
	<-cl.Done()
}
