package daemon

// Device-facing security and robustness: users, ACLs, TLS client
// certificates, limits and hostile byte streams. Every refusal is followed by
// a check that other clients are still served and the log still decodes.

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"golang.org/x/crypto/bcrypt"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/storage"
)

// startGateway is testGateway for any testing.TB (the fuzz target's F
// too), with the log captured.
func startGateway(tb testing.TB, mutate func(*config.Config)) (*Daemon, *testutil.Buffer) {
	tb.Helper()
	logs := &testutil.Buffer{}
	return startGatewayIn(tb, tb.TempDir(), mutate, logs), logs
}

func writeFile(tb testing.TB, path, content string) string {
	tb.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}

// usersFile writes a users file with the given user → password pairs, at
// bcrypt's lowest cost so that the tests stay fast.
func usersFile(tb testing.TB, path string, users ...string) string {
	tb.Helper()
	var b strings.Builder
	b.WriteString("# test users\n")
	for i := 0; i+1 < len(users); i += 2 {
		line, err := mqtt.HashPassword(users[i], []byte(users[i+1]), bcrypt.MinCost)
		if err != nil {
			tb.Fatal(err)
		}
		b.WriteString(line + "\n")
	}
	return writeFile(tb, path, b.String())
}

// connOpts is what a raw CONNECT carries.
type connOpts struct {
	version   byte // 4 (3.1.1) or 5
	id        string
	user      *string
	pass      *string
	keepAlive uint16
	willTopic string
	from      string // local address to connect from; "" for the default
}

func ptr(s string) *string { return &s }

func appendMQTTString(b []byte, s string) []byte {
	return append(append(b, byte(len(s)>>8), byte(len(s))), s...)
}

func connectBody(o connOpts) []byte {
	flags := byte(0x02) // clean start
	if o.user != nil {
		flags |= 0x80
	}
	if o.pass != nil {
		flags |= 0x40
	}
	if o.willTopic != "" {
		flags |= 0x04 | 0x08 // will, QoS 1
	}
	b := []byte{0, 4, 'M', 'Q', 'T', 'T', o.version, flags, byte(o.keepAlive >> 8), byte(o.keepAlive)}
	if o.version == 5 {
		b = append(b, 0) // no properties
	}
	b = appendMQTTString(b, o.id)
	if o.willTopic != "" {
		if o.version == 5 {
			b = append(b, 0)
		}
		b = appendMQTTString(b, o.willTopic)
		b = appendMQTTString(b, "gone")
	}
	if o.user != nil {
		b = appendMQTTString(b, *o.user)
	}
	if o.pass != nil {
		b = appendMQTTString(b, *o.pass)
	}
	return b
}

// connack is a CONNACK as a test sees it; closed means the gateway hung up
// without one.
type connack struct {
	code   byte
	props  *packets.Properties // MQTT 5 only
	closed bool
}

// mqttOn sends CONNECT over conn (plain or TLS) and reads the answer.
func mqttOn(t *testing.T, conn net.Conn, o connOpts) (*mqttConn, connack) {
	t.Helper()
	if o.keepAlive == 0 {
		o.keepAlive = 60
	}
	return mqttOnKA(t, conn, o)
}

// mqttOnKA is mqttOn with the keep-alive exactly as given, 0 included.
func mqttOnKA(t *testing.T, conn net.Conn, o connOpts) (*mqttConn, connack) {
	t.Helper()
	t.Cleanup(func() { conn.Close() })
	c := &mqttConn{rawConn: &rawConn{t, conn}, version: o.version}
	c.send(0x10, connectBody(o))
	typ, body := c.read()
	switch {
	case typ == 0:
		return c, connack{closed: true}
	case typ != 0x20 || len(body) < 2:
		t.Fatalf("answer to CONNECT: packet %#x %v", typ, body)
	}
	ca := connack{code: body[1]}
	if o.version == 5 {
		p := packets.Connack{Properties: &packets.Properties{}}
		if err := p.Unpack(bytes.NewBuffer(body)); err != nil {
			t.Fatalf("CONNACK %v: %v", body, err)
		}
		ca.props = p.Properties
	}
	return c, ca
}

// dialMQTT connects over TCP to addr and sends CONNECT.
func dialMQTTOpts(t *testing.T, addr string, o connOpts) (*mqttConn, connack) {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second}
	if o.from != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(o.from)}
	}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return mqttOn(t, conn, o)
}

// mustConnect connects and fails the test unless the CONNACK says yes.
func mustConnect(t *testing.T, addr string, o connOpts) *mqttConn {
	t.Helper()
	c, ca := dialMQTTOpts(t, addr, o)
	if ca.closed || ca.code != 0 {
		t.Fatalf("connect %s as %v: %+v", o.id, o.user, ca)
	}
	return c
}

// ack reads the next packet, which must be an ack of type typ (0x40
// PUBACK, 0x50 PUBREC) for pid, and returns its reason code.
func (c *mqttConn) ack(typ byte, pid uint16) byte {
	c.t.Helper()
	got, b := c.read()
	if got != typ || len(b) < 2 || uint16(b[0])<<8|uint16(b[1]) != pid {
		c.t.Fatalf("got packet %#x %v, want %#x for id %d", got, b, typ, pid)
	}
	if len(b) > 2 {
		return b[2]
	}
	return 0
}

// subscribe sends SUBSCRIBE with the filters (QoS 1 each) and returns the
// SUBACK's reason codes.
func (c *mqttConn) subscribe(pid uint16, filters ...string) []byte {
	c.t.Helper()
	b := []byte{byte(pid >> 8), byte(pid)}
	if c.version == 5 {
		b = append(b, 0)
	}
	for _, f := range filters {
		b = append(appendMQTTString(b, f), 1)
	}
	c.send(0x82, b)
	typ, body := c.read()
	if typ != 0x90 || len(body) < 2 || uint16(body[0])<<8|uint16(body[1]) != pid {
		c.t.Fatalf("answer to SUBSCRIBE: %#x %v", typ, body)
	}
	if c.version == 5 {
		s := packets.Suback{Properties: &packets.Properties{}}
		if err := s.Unpack(bytes.NewBuffer(body)); err != nil {
			c.t.Fatalf("SUBACK %v: %v", body, err)
		}
		return s.Reasons
	}
	return body[2:]
}

// expectClosed reads until the gateway hangs up; a v5 DISCONNECT on the
// way is returned (0 when there was none).
func (c *mqttConn) expectClosed() byte {
	c.t.Helper()
	var reason byte
	for {
		typ, b := c.read()
		switch {
		case typ == 0:
			return reason
		case typ == 0xe0 && len(b) > 0:
			reason = b[0]
		case typ == 0xe0:
		default:
			c.t.Fatalf("got packet %#x %v, want the connection closed", typ, b)
		}
	}
}

// assertServing checks the gateway still serves: a client (user and
// password when given) publishes QoS 1 and gets its PUBACK, a subscriber
// receives it, and the log decodes from first to last record. It returns
// the log.
func assertServing(t *testing.T, d *Daemon, user, pass string) []storage.Record {
	t.Helper()
	return assertServingFrom(t, d, "", user, pass)
}

// servingChecks numbers assertServing's topics.
var servingChecks atomic.Int64

// assertServingFrom is assertServing with clients connecting from the
// local address from.
func assertServingFrom(t *testing.T, d *Daemon, from, user, pass string) []storage.Record {
	t.Helper()
	o := connOpts{version: 5, id: "serving-" + fmt.Sprint(time.Now().UnixNano()), from: from}
	if user != "" {
		o.user, o.pass = ptr(user), ptr(pass)
	}
	sub := mustConnect(t, d.MQTTAddr(), o)
	// A topic of this check's own: a slave may still be applying an
	// earlier check's publish when this subscription starts, and a server
	// may send matching PUBLISHes before the SUBACK (MQTT 3.8.4), which
	// subscribe would take for a wrong answer.
	topic := fmt.Sprint("ok/check", servingChecks.Add(1)) // within TestTopicLimits' 32 bytes
	if codes := sub.subscribe(1, topic); codes[0] >= 0x80 {
		t.Fatalf("subscribe %s: %x", topic, codes)
	}
	o.id += "-pub"
	pub := mustConnect(t, d.MQTTAddr(), o)
	payload := "still serving " + o.id
	pub.pub(topic, 1, false, 7, nil, payload)
	if r := pub.ack(0x40, 7); r != 0 {
		t.Fatalf("PUBACK reason %#x", r)
	}
	for {
		typ, b := sub.read()
		if typ == 0 {
			t.Fatal("subscriber disconnected")
		}
		if typ&0xf0 == 0x30 && bytes.Contains(b, []byte(payload)) {
			break
		}
	}
	recs := logRecords(t, d)
	if n := countTopic(t, d, topic); n == 0 {
		t.Fatal("acked publish not in the log")
	}
	if err := d.Err(); err != nil {
		t.Fatalf("the node failed: %v", err)
	}
	return recs
}

// noRecordFrom fails when a client's publish reached the log.
func noRecordFrom(t *testing.T, recs []storage.Record, clients ...string) {
	t.Helper()
	for _, r := range recs {
		for _, c := range clients {
			if r.ClientID == c {
				t.Fatalf("refused client %s has a record in the log: %s", c, r.Topic)
			}
		}
	}
}

// ---------------------------------------------------------------------------
// Users.

func TestWrongPasswordAndUnknownUserRefused(t *testing.T) {
	dir := t.TempDir()
	users := usersFile(t, filepath.Join(dir, "users"), "alice", "wonderland", "bob", "builder")
	d, logs := startGateway(t, func(c *config.Config) { c.MQTT.UsersFile = users })
	// A client connected before the refusals must stay served.
	early := mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "early", user: ptr("bob"), pass: ptr("builder")})

	for _, tt := range []struct {
		name       string
		o          connOpts
		code       byte
		logMessage string
	}{
		{"v5 wrong password", connOpts{version: 5, id: "x1", user: ptr("alice"), pass: ptr("nope")}, 0x86, "bad user name or password"},
		{"v5 unknown user", connOpts{version: 5, id: "x2", user: ptr("mallory"), pass: ptr("wonderland")}, 0x86, "bad user name or password"},
		{"v5 no password", connOpts{version: 5, id: "x3", user: ptr("alice")}, 0x86, "bad user name or password"},
		{"v5 anonymous", connOpts{version: 5, id: "x4"}, 0x87, "anonymous client not allowed"},
		{"3.1.1 wrong password", connOpts{version: 4, id: "x5", user: ptr("alice"), pass: ptr("nope")}, 0x04, "bad user name or password"},
		{"3.1.1 unknown user", connOpts{version: 4, id: "x6", user: ptr("mallory"), pass: ptr("x")}, 0x04, "bad user name or password"},
		{"3.1.1 anonymous", connOpts{version: 4, id: "x7"}, 0x05, "anonymous client not allowed"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, ca := dialMQTTOpts(t, d.MQTTAddr(), tt.o)
			if ca.closed || ca.code != tt.code {
				t.Fatalf("CONNACK %+v, want reason %#x", ca, tt.code)
			}
			c.expectClosed()
			if !strings.Contains(logs.String(), tt.logMessage) {
				t.Fatalf("refusal not logged: %q", tt.logMessage)
			}
		})
	}
	// A flood of wrong passwords is one log line, not one per attempt.
	for i := 0; i < 10; i++ {
		c, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "flood", user: ptr("alice"), pass: ptr("guess")})
		if ca.code != 0x86 {
			t.Fatalf("attempt %d: %+v", i, ca)
		}
		c.Close()
	}
	if n := logs.Count("bad user name or password"); n != 1 {
		t.Errorf("bad passwords logged %d times from one address, want once a minute:\n%s", n, logs)
	}

	// The guesses put their address in backoff: there even the right
	// password is refused at once, without a bcrypt check, for a while.
	if _, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "right", user: ptr("alice"), pass: ptr("wonderland")}); ca.code != 0x86 {
		t.Fatalf("the right password from the guessing address: %+v, want 0x86 while it backs off", ca)
	}
	if !strings.Contains(logs.String(), "login backoff after failed logins") {
		t.Error("the backoff refusal was not logged")
	}
	early.pub("ok/early", 1, false, 1, nil, "x")
	if r := early.ack(0x40, 1); r != 0 {
		t.Fatalf("early client: PUBACK %#x", r)
	}
	// alice herself, from another address, gets in: her name's own
	// backoff only delays her login (a few seconds at most).
	recs := assertServingFrom(t, d, "127.0.0.2", "alice", "wonderland")
	noRecordFrom(t, recs, "x1", "x2", "x3", "x4", "x5", "x6", "x7", "flood")
}

// Without a users file, user names are not checked, so they are not
// trusted either: such a client gets the anonymous part of the ACL.
func TestUnverifiedUserNameIsAnonymousForACL(t *testing.T) {
	dir := t.TempDir()
	acl := writeFile(t, filepath.Join(dir, "acl"), "topic readwrite public/#\nuser admin\ntopic readwrite #\n")
	d, _ := startGateway(t, func(c *config.Config) { c.MQTT.ACLFile = acl })
	c := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "claims-admin", user: ptr("admin"), pass: ptr("whatever")})
	c.pub("secret/x", 1, false, 1, nil, "x")
	if r := c.ack(0x40, 1); r != 0x87 {
		t.Fatalf("unverified user name got its section: PUBACK %#x, want 0x87", r)
	}
	c.pub("public/x", 1, false, 2, nil, "x")
	if r := c.ack(0x40, 2); r != 0 {
		t.Fatalf("anonymous section: PUBACK %#x", r)
	}
}

// ---------------------------------------------------------------------------
// ACLs.

const aclText = `# anonymous: nothing
user alice
topic readwrite alice/#
topic readwrite ok/#
topic read shared/#
topic deny shared/secret
user bob
topic readwrite #
`

func aclGateway(t *testing.T) (*Daemon, *testutil.Buffer) {
	dir := t.TempDir()
	users := usersFile(t, filepath.Join(dir, "users"), "alice", "a", "bob", "b")
	acl := writeFile(t, filepath.Join(dir, "acl"), aclText)
	return startGateway(t, func(c *config.Config) { c.MQTT.UsersFile, c.MQTT.ACLFile = users, acl })
}

func TestACLDeniedPublishMQTT5AckedInOrder(t *testing.T) {
	d, logs := aclGateway(t)
	c := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "alice5", user: ptr("alice"), pass: ptr("a")})
	// Pipelined: the refusal comes in its turn, between two successes.
	c.pub("alice/1", 1, false, 1, nil, "a")
	c.pub("bob/1", 1, false, 2, nil, "denied")
	c.pub("alice/2", 1, false, 3, nil, "b")
	c.pub("bob/2", 2, false, 4, nil, "denied qos2")
	c.pub("bob/3", 0, false, 0, nil, "denied qos0")
	for _, want := range []struct {
		typ    byte
		pid    uint16
		reason byte
	}{{0x40, 1, 0}, {0x40, 2, 0x87}, {0x40, 3, 0}, {0x50, 4, 0x87}} {
		if r := c.ack(want.typ, want.pid); r != want.reason {
			t.Fatalf("ack %#x for id %d: reason %#x, want %#x", want.typ, want.pid, r, want.reason)
		}
	}
	// Still connected.
	c.pub("alice/3", 1, false, 5, nil, "c")
	if r := c.ack(0x40, 5); r != 0 {
		t.Fatalf("after the refusals: PUBACK %#x", r)
	}
	if logs.Count("publish denied by ACL") != 1 {
		t.Errorf("three refused publishes logged %d times, want once:\n%s", logs.Count("publish denied by ACL"), logs)
	}
	for _, r := range assertServing(t, d, "bob", "b") {
		if strings.HasPrefix(r.Topic, "bob/") {
			t.Fatalf("a refused publish reached the log: %s", r.Topic)
		}
	}
	if n := countTopic(t, d, "alice/3"); n != 1 {
		t.Fatalf("alice/3 in the log %d times", n)
	}
}

func TestACLDeniedPublishMQTT311Disconnects(t *testing.T) {
	d, _ := aclGateway(t)
	c := mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "alice3", user: ptr("alice"), pass: ptr("a")})
	c.pub("alice/1", 1, false, 1, nil, "a")
	c.pub("bob/1", 1, false, 2, nil, "denied")
	c.expect(0x40, 1)
	if typ, b := c.read(); typ != 0 {
		t.Fatalf("3.1.1 client got %#x %v for a denied publish, want a disconnect (it has no negative ack)", typ, b)
	}
	assertServing(t, d, "alice", "a")
	if countTopic(t, d, "bob/1") != 0 || countTopic(t, d, "alice/1") != 1 {
		t.Fatal("the log does not hold exactly the allowed publish")
	}
}

func TestACLDeniedSubscribePerFilter(t *testing.T) {
	d, _ := aclGateway(t)
	for _, tt := range []struct {
		version byte
		denied  byte
	}{{5, 0x87}, {4, 0x80}} {
		c := mustConnect(t, d.MQTTAddr(), connOpts{version: tt.version, id: fmt.Sprint("sub", tt.version), user: ptr("alice"), pass: ptr("a")})
		got := c.subscribe(1, "alice/#", "bob/#", "#", "shared/+/x")
		want := []byte{1, tt.denied, tt.denied, 1}
		if !bytes.Equal(got, want) {
			t.Fatalf("version %d: SUBACK %x, want %x", tt.version, got, want)
		}
	}
	assertServing(t, d, "alice", "a")
}

// A will is a publish too: refused at CONNECT when its topic is not
// writable, and dropped when a reload has taken the topic away by the time
// it would be sent.
func TestWillTopicCheckedAgainstACL(t *testing.T) {
	d, _ := aclGateway(t)
	for _, tt := range []struct{ version, code byte }{{5, 0x87}, {4, 0x05}} {
		_, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: tt.version, id: "w", user: ptr("alice"), pass: ptr("a"), willTopic: "bob/will"})
		if ca.closed || ca.code != tt.code {
			t.Fatalf("version %d, will on a topic alice may not write: %+v, want CONNACK %#x", tt.version, ca, tt.code)
		}
	}
	w := mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "willer", user: ptr("alice"), pass: ptr("a"), willTopic: "alice/will"})
	testutil.WaitFor(t, 5*time.Second, "one client", func() bool { return d.broker.Clients() == 1 })
	acl := d.live.MQTT.ACLFile
	writeFile(t, acl, strings.Replace(aclText, "topic readwrite alice/#\n", "topic readwrite alice/#\ntopic deny alice/will\n", 1))
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	w.Close() // no DISCONNECT: the will would fire
	testutil.WaitFor(t, 5*time.Second, "the disconnect", func() bool { return d.broker.Clients() == 0 })
	assertServing(t, d, "bob", "b") // logged after the will, had it been
	if n := countTopic(t, d, "alice/will"); n != 0 {
		t.Fatalf("a will the ACL denies was logged %d times", n)
	}
}

// A retained message the client may not read must not reach it, neither
// at subscribe time nor live, even under a filter it may subscribe to.
func TestRetainedMessagesDoNotLeakPastTheACL(t *testing.T) {
	d, _ := aclGateway(t)
	bob := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "bob", user: ptr("bob"), pass: ptr("b")})
	bob.send(0x33, pubBody("shared/public", 1, "public")) // QoS 1, retained
	bob.ack(0x40, 1)
	bob.send(0x33, pubBody("shared/secret", 2, "secret")) // QoS 1, retained
	bob.ack(0x40, 2)

	alice, got := v5Auth(t, d.MQTTAddr(), "alice-sub", "alice", "a")
	subscribe(t, alice, "shared/#", 1)
	bob.pub("shared/secret", 1, false, 3, nil, "live secret")
	bob.ack(0x40, 3)
	bob.pub("shared/zz", 1, false, 4, nil, "marker")
	bob.ack(0x40, 4)
	// Retained messages go out after the SUBACK, on the subscriber's own
	// goroutine, so live ones may overtake them: wait for both kinds.
	seen := map[string]bool{}
	for !seen["marker"] || !seen["public"] {
		p := receive(t, got, 5*time.Second)
		seen[string(p.Payload)] = true
	}
	bob.pub("shared/zz", 1, false, 5, nil, "marker 2")
	bob.ack(0x40, 5)
	for !seen["marker 2"] {
		p := receive(t, got, 5*time.Second)
		seen[string(p.Payload)] = true
	}
	if seen["secret"] || seen["live secret"] {
		t.Fatalf("a message the ACL denies reached the client: %v", seen)
	}
}

func pubBody(topic string, pid uint16, payload string) []byte {
	b := appendMQTTString(nil, topic)
	b = append(b, byte(pid>>8), byte(pid), 0) // packet id, no properties
	return append(b, payload...)
}

// v5Auth is v5 with a user name and password.
func v5Auth(t *testing.T, addr, id, user, pass string) (*paho.Client, chan *paho.Publish) {
	t.Helper()
	return v5(t, addr, id, &paho.Connect{CleanStart: true, Username: user, UsernameFlag: true, Password: []byte(pass), PasswordFlag: true})
}
