package e2e

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// Wall-clock jumps (issue #33, DESIGN.md "Time"): a board without a
// real-time clock jumps by years when NTP syncs. The gateway runs a test
// build (-tags tandem_testclock) whose wall clock a file moves while the
// monotonic clock runs on; release builds have no such door.

// clockConfig: records older than an hour are dropped. (No uplink: what
// an uplink has not sent is kept whatever its age, retention's floor,
// which no clock moves; a log that only max_age bounds is what a jump
// could empty.)
const clockConfig = `storage:
  max_age: 1h`

const fiveYears = 5 * 365 * 24 * time.Hour

// clockGW is a gateway of the test-clock build and the file that shifts
// its wall clock.
type clockGW struct {
	*gw
	bin, shift string
	env        []string
}

func startClockGW(t *testing.T, raw bool, config ...string) *clockGW {
	netns.Skip(t)
	nt := netns.New(t, 1)
	if len(config) == 0 {
		config = []string{clockConfig}
	}
	g := &clockGW{gw: newGW(t, nt.Hosts[0], "gw-1", config...), bin: tagBin(t, "tandem_testclock", "tandem-testclock")}
	g.shift = filepath.Join(t.TempDir(), "shift")
	g.setShift(0)
	g.env = []string{"TANDEM_TEST_CLOCK_SHIFT=" + g.shift}
	if raw {
		g.env = append(g.env, "TANDEM_TEST_CLOCK_RAW=1")
	}
	g.run()
	return g
}

// run starts the gateway and waits for its API.
func (g *clockGW) run() {
	g.t.Helper()
	cmd := g.h.Command(g.bin, "run", "--config", g.cfg)
	cmd.Env = append(os.Environ(), g.env...)
	p := g.h.Start(cmd)
	g.proc = p
	g.t.Cleanup(func() {
		if g.t.Failed() {
			g.t.Logf("%s output:\n%s", g.name, p.Output())
		}
	})
	testutil.WaitFor(g.t, 15*time.Second, g.name+" serving", func() bool { return g.status() != nil })
}

// setShift moves the gateway's wall clock to the host's plus d.
func (g *clockGW) setShift(d time.Duration) {
	if err := os.WriteFile(g.shift, []byte(d.String()), 0o600); err != nil {
		g.t.Fatal(err)
	}
}

// clockStatus is the part of the status a clock test reads.
type clockStatus struct {
	Log struct {
		FirstIndex uint64 `json:"first_index"`
		LastIndex  uint64 `json:"last_index"`
	} `json:"log"`
	Storage struct {
		Dropped uint64 `json:"dropped_records"`
	} `json:"storage"`
}

func (g *clockGW) clockStatus() clockStatus {
	g.t.Helper()
	var s clockStatus
	if !g.statusAs(&s) {
		g.t.Fatalf("%s: no status", g.name)
	}
	return s
}

// jumped waits until the gateway counted n jumps of its wall clock.
func (g *clockGW) jumped(n uint64) {
	g.t.Helper()
	testutil.WaitFor(g.t, 10*time.Second, fmt.Sprintf("%s counting %d wall-clock jumps", g.name, n), func() bool {
		return metric(g.t, g.gw, "tandem_clock_jumps_total") >= n
	})
}

// publishN publishes n QoS 1 messages on d/<tag>/i and fails unless each
// is acked.
func publishN(t *testing.T, c *paho.Client, tag string, n int) {
	t.Helper()
	for i := range n {
		if _, err := c.Publish(t.Context(), &paho.Publish{Topic: fmt.Sprintf("d/%s/%d", tag, i), QoS: 1, Payload: []byte(tag)}); err != nil {
			t.Fatalf("publish d/%s/%d: %v", tag, i, err)
		}
	}
}

// retainWithExpiry publishes a retained QoS 1 message on topic that
// expires after secs (0: never).
func retainWithExpiry(t *testing.T, c *paho.Client, topic string, secs uint32) {
	t.Helper()
	p := &paho.Publish{Topic: topic, QoS: 1, Retain: true, Payload: []byte(topic)}
	if secs > 0 {
		p.Properties = &paho.PublishProperties{MessageExpiry: &secs}
	}
	if _, err := c.Publish(t.Context(), p); err != nil {
		t.Fatalf("retain %s: %v", topic, err)
	}
}

// retainedNow says whether a new subscriber gets topic's retained message:
// it subscribes to topic, then to r/marker (always retained); the marker
// comes after anything topic had, on the one connection.
func (g *clockGW) retainedNow(topic string) bool {
	g.t.Helper()
	var mu sync.Mutex
	got := map[string]bool{}
	c, err := device(g.t, g.gw, fmt.Sprintf("look-%d", time.Now().UnixNano()), func(p *paho.Publish) {
		mu.Lock()
		got[p.Topic] = true
		mu.Unlock()
	})
	if err != nil {
		g.t.Fatal(err)
	}
	defer c.Disconnect(&paho.Disconnect{})
	for _, f := range []string{topic, "r/marker"} {
		if _, err := c.Subscribe(g.t.Context(), &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: f, QoS: 1}}}); err != nil {
			g.t.Fatal(err)
		}
	}
	testutil.WaitFor(g.t, 5*time.Second, "the retained marker", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return got["r/marker"]
	})
	mu.Lock()
	defer mu.Unlock()
	return got[topic]
}

// beforeTheJump connects a publisher and logs what both tests start from:
// the retained marker, 50 records and a retained message with an hour to
// live.
func (g *clockGW) beforeTheJump() *paho.Client {
	g.t.Helper()
	pub, err := device(g.t, g.gw, "pub", nil)
	if err != nil {
		g.t.Fatal(err)
	}
	retainWithExpiry(g.t, pub, "r/marker", 0)
	publishN(g.t, pub, "before", 50)
	retainWithExpiry(g.t, pub, "r/hour", 3600)
	return pub
}

// cpuTime is the process's CPU time so far (user and system).
func (g *clockGW) cpuTime() time.Duration {
	g.t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", g.proc.Cmd.Process.Pid))
	if err != nil {
		g.t.Fatal(err)
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+2:]))
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * (time.Second / 100) // USER_HZ
}

// stays fails unless ok holds throughout d (a promise that something does
// not happen needs that long to be seen).
func stays(t *testing.T, d time.Duration, what string, ok func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	testutil.WaitFor(t, d+5*time.Second, what, func() bool {
		if !ok() {
			t.Fatalf("not %s", what)
		}
		return time.Now().After(end)
	})
}

// TestWallClockJumpsAreAbsorbed: under load, with max_age 1h, the wall
// clock jumps 5 years forward, then 10 back, then the gateway restarts on
// it. Nothing is dropped, a
// retained message that expires in an hour is still there after the jump
// forward and one that expires in 3 s is gone 3 s after it was published
// even though the clock went back 10 years meanwhile, a will with a 2 s
// delay comes in about 2 s, the gateway does not spin, and it stops on
// SIGTERM within 5 s.
func TestWallClockJumpsAreAbsorbed(t *testing.T) {
	// On a network of its own, mostly waiting: beside the other such tests
	// (make test's time).
	t.Parallel()
	g := startClockGW(t, false)
	pub := g.beforeTheJump()
	before := g.clockStatus()

	g.setShift(fiveYears)
	g.jumped(1)
	publishN(t, pub, "ahead", 20)
	stays(t, 3*time.Second, "keeping every record after a jump of 5 years forward", func() bool {
		s := g.clockStatus()
		return s.Storage.Dropped == 0 && s.Log.FirstIndex == before.Log.FirstIndex
	})
	if !g.retainedNow("r/hour") {
		t.Fatal("a retained message with an hour to live expired at a jump of 5 years forward")
	}

	// Will and short expiry straddle the jump back.
	var mu sync.Mutex
	var willAt time.Time
	sub, err := device(t, g.gw, "will-watch", func(p *paho.Publish) {
		mu.Lock()
		willAt = time.Now()
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Subscribe(t.Context(), &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "will/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	wc, err := dialIn(g.h, g.h.Addr()+":1883")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wc.Write(willConnect("willer", "will/willer", 60, 2)); err != nil {
		t.Fatal(err)
	}
	ack := make([]byte, 4)
	_ = wc.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := wc.Read(ack); err != nil || ack[0] != 0x20 {
		t.Fatalf("will CONNECT: %x %v", ack, err)
	}
	retainWithExpiry(t, pub, "r/short", 3)
	shortAt := time.Now()

	g.setShift(-fiveYears)
	g.jumped(2)
	wc.Close() // no DISCONNECT: the will is due in 2 s
	droppedAt := time.Now()
	cpu0, wall0 := g.cpuTime(), time.Now()
	publishN(t, pub, "behind", 20)

	testutil.WaitFor(t, 15*time.Second, "the will after its 2 s delay", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return !willAt.IsZero()
	})
	if d := willAt.Sub(droppedAt); d < 1500*time.Millisecond {
		t.Fatalf("the will came %v after its connection dropped, before its 2 s delay", d)
	}
	testutil.WaitFor(t, 10*time.Second, "r/short's 3 s to pass", func() bool { return time.Since(shortAt) > 3500*time.Millisecond })
	if g.retainedNow("r/short") {
		t.Fatal("a retained message with 3 s to live outlived them by a jump of the clock back")
	}
	if !g.retainedNow("r/hour") {
		t.Fatal("a retained message with an hour to live expired after the jumps")
	}
	// No spin: the jumps must leave no timer firing in a loop.
	stays(t, 2*time.Second, "the gateway idling after the jumps", func() bool { return true })
	if cpu, wall := g.cpuTime()-cpu0, time.Since(wall0); cpu > wall/2 {
		t.Fatalf("the gateway used %v of CPU in %v after the jumps", cpu, wall.Round(time.Millisecond))
	}
	after := g.clockStatus()
	want := before.Log.LastIndex + 20 + 20 + 1 // the publishes and the retained message since
	if after.Storage.Dropped != 0 || after.Log.FirstIndex != before.Log.FirstIndex || after.Log.LastIndex < want {
		t.Fatalf("after the jumps: first index %d (was %d), last %d (want ≥ %d), %d dropped", after.Log.FirstIndex, before.Log.FirstIndex, after.Log.LastIndex, want, after.Storage.Dropped)
	}
	pub.Disconnect(&paho.Disconnect{})
	sub.Disconnect(&paho.Disconnect{})

	// A restart on the shifted clock keeps what was absorbed.
	g.stopWithin(5 * time.Second)
	g.run()
	stays(t, 3*time.Second, "keeping every record after a restart on the shifted clock", func() bool {
		s := g.clockStatus()
		return s.Storage.Dropped == 0 && s.Log.FirstIndex == before.Log.FirstIndex
	})
	if !g.retainedNow("r/hour") {
		t.Fatal("a retained message with an hour to live expired at a restart after the jumps")
	}
	t.Logf("jumps of +5 and -10 years and a restart: nothing dropped (first index %d), will after %v", before.Log.FirstIndex, willAt.Sub(droppedAt).Round(time.Millisecond))
	g.stopWithin(5 * time.Second)
}

// TestWallClockJumpHarnessSeesAFollowedJump is the control: with the
// jumps followed instead of absorbed (TANDEM_TEST_CLOCK_RAW, what a build
// reading the wall clock does), the jump of 5 years forward drops the
// log to max_age and expires the hour's retained message, so the test
// above can fail.
func TestWallClockJumpHarnessSeesAFollowedJump(t *testing.T) {
	// On a network of its own, mostly waiting: beside the other such tests
	// (make test's time).
	t.Parallel()
	g := startClockGW(t, true)
	pub := g.beforeTheJump()
	g.setShift(fiveYears)
	g.jumped(1)
	testutil.WaitFor(t, 10*time.Second, "max_age dropping the log at a followed jump", func() bool {
		return g.clockStatus().Storage.Dropped > 0
	})
	if g.retainedNow("r/hour") {
		t.Fatal("a followed jump of 5 years did not expire a retained message with an hour to live")
	}
	pub.Disconnect(&paho.Disconnect{})
	g.stopWithin(5 * time.Second)
}

// uplinkClockConfig: an uplink to a cloud nobody answers (the discard
// port of the gateway's own host), which holds every d/ record as its
// backlog, with max_age as above.
const uplinkClockConfig = clockConfig + `
uplinks:
  - name: cloud
    broker: tcp://127.0.0.1:9
    topics:
      - match: "d/#"
    reconnect_min: 1s
    reconnect_max: 2s`

// uplinkView is the part of the status an uplink clock test reads.
type uplinkView struct {
	Uplinks []struct {
		Backlog   int64   `json:"backlog_records"`
		OldestAge float64 `json:"oldest_age_seconds"`
	} `json:"uplinks"`
}

func (g *clockGW) uplink() (backlog int64, oldest float64) {
	g.t.Helper()
	var v uplinkView
	if !g.statusAs(&v) || len(v.Uplinks) != 1 {
		g.t.Fatalf("%s: no uplink in the status", g.name)
	}
	return v.Uplinks[0].Backlog, v.Uplinks[0].OldestAge
}

// TestWallClockJumpsKeepTheUplinkBacklog: with the cloud out of reach, the
// uplink's backlog is the log's; a jump of 5 years forward then 10 back
// leaves it whole, and its oldest record's age, what an operator watches
// to see how far behind the cloud is, stays what the monotonic clock
// says (seconds, not 5 years, nor a negative age clamped to 0 for years).
// Its control (raw): the same jump followed reads 5 years.
func TestWallClockJumpsKeepTheUplinkBacklog(t *testing.T) {
	// On a network of its own, mostly waiting: beside the other such tests
	// (make test's time).
	t.Parallel()
	for _, raw := range []bool{false, true} {
		g := startClockGW(t, raw, uplinkClockConfig)
		pub := g.beforeTheJump()
		testutil.WaitFor(t, 10*time.Second, "the uplink's backlog of 50", func() bool {
			n, _ := g.uplink()
			return n == 50
		})
		g.setShift(fiveYears)
		g.jumped(1)
		publishN(t, pub, "ahead", 10)
		testutil.WaitFor(t, 10*time.Second, "the uplink's backlog of 60 after the jump", func() bool {
			n, _ := g.uplink()
			return n == 60
		})
		_, age := g.uplink()
		if raw {
			if age < float64(fiveYears/time.Second)/2 {
				t.Fatalf("control: a followed jump of 5 years gives the backlog's oldest record an age of %.0f s", age)
			}
			pub.Disconnect(&paho.Disconnect{})
			g.stopWithin(5 * time.Second)
			continue
		}
		if age > 600 {
			t.Fatalf("after a jump of 5 years forward the backlog's oldest record is %.0f s old", age)
		}
		g.setShift(-fiveYears)
		g.jumped(2)
		publishN(t, pub, "behind", 10)
		stays(t, 2*time.Second, "the backlog whole (70) after a jump of 10 years back", func() bool {
			n, _ := g.uplink()
			return n == 70
		})
		if _, age := g.uplink(); age > 600 || age <= 0 {
			t.Fatalf("after jumps of +5 and -10 years the backlog's oldest record is %.0f s old", age)
		}
		pub.Disconnect(&paho.Disconnect{})
		g.stopWithin(5 * time.Second)
	}
}

// willConnect is an MQTT 5 CONNECT of id with session expiry secs and a
// will on topic delayed by delay seconds.
func willConnect(id, topic string, expiry, delay uint32) []byte {
	b := mqttString(nil, "MQTT")
	b = append(b, 5, 0x04, 0, 30) // will flag; not clean: the session outlives the connection
	props := binary.BigEndian.AppendUint32([]byte{0x11}, expiry)
	b = binary.AppendUvarint(b, uint64(len(props)))
	b = append(b, props...)
	b = mqttString(b, id)
	wprops := binary.BigEndian.AppendUint32([]byte{0x18}, delay)
	b = binary.AppendUvarint(b, uint64(len(wprops)))
	b = append(b, wprops...)
	b = mqttString(b, topic)
	b = mqttString(b, "gone")
	return testutil.MQTTFrame(0x10, b)
}
