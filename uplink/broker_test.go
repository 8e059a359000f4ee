package uplink

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/autopaho"
	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/cloudtest"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// cloud is a mosquitto the test runs as the cloud broker, on a loopback
// port of its own, with persistence so that a restart keeps the recording
// subscriber's queued messages.
type cloud struct {
	t    testing.TB
	dir  string
	port int
	cmd  *exec.Cmd
	done chan struct{}
}

// mosquittoPath finds the broker binary; without it the test skips, and
// fails under CI=true (.ci/run installs it).
func mosquittoPath(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"/usr/sbin/mosquitto", "mosquitto"} {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("mosquitto not installed (Debian package mosquitto)")
	}
	t.Skip("mosquitto not installed (Debian package mosquitto)")
	return ""
}

func startCloud(t testing.TB) *cloud {
	t.Helper()
	return startCloudWith(t, func(string) string { return "" })
}

// startCloudWith runs a cloud whose config ends with what extra returns
// (given the cloud's directory): more listeners.
func startCloudWith(t testing.TB, extra func(dir string) string) *cloud {
	t.Helper()
	c := &cloud{t: t, dir: t.TempDir(), port: testutil.FreePort(t)}
	// As root, mosquitto switches to its own user, which cannot write the
	// test's directory (persistence, log) unless told to stay.
	conf := ""
	if os.Geteuid() == 0 {
		conf = "user root\n"
	}
	conf += fmt.Sprintf("per_listener_settings true\npersistence true\npersistence_location %s/\n"+
		"max_queued_messages 0\nmax_inflight_messages 0\nlog_dest file %s/mosquitto.log\n"+
		"listener %d 127.0.0.1\nallow_anonymous true\n",
		c.dir, c.dir, c.port)
	conf += extra(c.dir)
	if err := os.WriteFile(filepath.Join(c.dir, "mosquitto.conf"), []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	c.start()
	t.Cleanup(func() {
		c.stop(syscall.SIGKILL)
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(c.dir, "mosquitto.log"))
			if len(b) > 4000 {
				b = b[len(b)-4000:]
			}
			t.Logf("mosquitto.log:\n%s", b)
		}
	})
	return c
}

func (c *cloud) url() string { return "tcp://127.0.0.1:" + strconv.Itoa(c.port) }

// start runs mosquitto and waits until it accepts connections.
func (c *cloud) start() {
	c.t.Helper()
	c.cmd = exec.Command(mosquittoPath(c.t), "-c", filepath.Join(c.dir, "mosquitto.conf"))
	if err := c.cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	c.done = make(chan struct{})
	cmd, done := c.cmd, c.done
	go func() { _ = cmd.Wait(); close(done) }()
	testutil.WaitFor(c.t, 5*time.Second, "mosquitto to listen", func() bool {
		conn, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(c.port), 100*time.Millisecond)
		if err == nil {
			conn.Close()
		}
		return err == nil
	})
}

// stop signals the mosquitto this test started, by its PID, and waits for
// it to exit.
func (c *cloud) stop(sig syscall.Signal) {
	if c.cmd == nil {
		return
	}
	_ = c.cmd.Process.Signal(sig)
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
	c.cmd = nil
}

// got is one message as the cloud subscriber received it.
type got struct {
	topic   string
	payload string
	id      string // tandem-id
	qos     byte
}

// recorder subscribes at the cloud and records what arrives, in arrival
// order. Its session outlives a broker restart.
type recorder struct {
	mu   sync.Mutex
	msgs []got
	subs int // subscriptions made, one per connection
	cm   *autopaho.ConnectionManager
}

func (r *recorder) subscriptions() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.subs
}

func newRecorder(t testing.TB, c *cloud, filter string) *recorder {
	t.Helper()
	r := &recorder{}
	u, _ := url.Parse("mqtt://127.0.0.1:" + strconv.Itoa(c.port))
	ready := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	cfg := autopaho.ClientConfig{
		ServerUrls:                    []*url.URL{u},
		KeepAlive:                     5,
		CleanStartOnInitialConnection: true,
		SessionExpiryInterval:         3600,
		ReconnectBackoff:              autopaho.NewConstantBackoff(50 * time.Millisecond),
		OnConnectionUp: func(cm *autopaho.ConnectionManager, _ *paho.Connack) {
			go func() {
				if _, err := cm.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: 1}}}); err == nil {
					r.mu.Lock()
					r.subs++
					r.mu.Unlock()
					select {
					case ready <- struct{}{}:
					default:
					}
				}
			}()
		},
		ClientConfig: paho.ClientConfig{
			ClientID: "recorder",
			OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
				m := cloudtest.Received(pr.Packet)
				g := got{topic: m.Topic, payload: m.Payload, id: m.ID, qos: pr.Packet.QoS}
				r.mu.Lock()
				r.msgs = append(r.msgs, g)
				r.mu.Unlock()
				return true, nil
			}},
		},
	}
	cm, err := autopaho.NewConnection(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.cm = cm
	select {
	case <-ready:
	case <-time.After(5 * time.Second):
		t.Fatal("recorder did not subscribe")
	}
	t.Cleanup(func() {
		dctx, dcancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = cm.Disconnect(dctx)
		dcancel()
		cancel()
		<-cm.Done()
	})
	return r
}

func (r *recorder) all() []got {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]got(nil), r.msgs...)
}

// distinct is how many different payloads (the tests make them unique)
// arrived.
func (r *recorder) distinct() int {
	seen := map[string]bool{}
	for _, g := range r.all() {
		seen[g.payload] = true
	}
	return len(seen)
}

// publishAtCloud publishes one message at the cloud, as a cloud
// application sending a command would.
func publishAtCloud(t testing.TB, c *cloud, topic, payload string) {
	t.Helper()
	cloudtest.Publish(t, func() (net.Conn, error) { return net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(c.port)) }, topic, payload)
}

// missingAbove lists the forwarded records above index floor that did
// not reach the cloud.
func (r *recorder) missingAbove(l *memLog, floor uint64) []uint64 {
	seen := map[string]bool{}
	for _, g := range r.all() {
		seen[g.payload] = true
	}
	var miss []uint64
	for i := floor + 1; i <= l.last(); i++ {
		if rec := l.get(i); strings.HasPrefix(rec.Topic, "dev/") && !seen[string(rec.Payload)] {
			miss = append(miss, i)
		}
	}
	return miss
}

// missing summarises what did not reach the cloud, for failures.
func (r *recorder) missing(l *memLog) string {
	miss := r.missingAbove(l, 0)
	if len(miss) == 0 {
		return "no record missing at the cloud"
	}
	return fmt.Sprintf("%d records missing at the cloud, indexes %d..%d", len(miss), miss[0], miss[len(miss)-1])
}
