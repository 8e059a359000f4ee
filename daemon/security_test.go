package daemon

// Device-facing security and robustness: users, ACLs, TLS client
// certificates, limits and hostile byte streams. Every refusal is followed by
// a check that other clients are still served and the log still decodes.

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"golang.org/x/crypto/bcrypt"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/storage"
)

// logBuf collects a gateway's log lines.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// count returns how many log lines contain s.
func (l *logBuf) count(s string) int { return strings.Count(l.String(), s) }

// startGateway is testGateway for any testing.TB (the fuzz target's F
// too), with the log captured.
func startGateway(tb testing.TB, mutate func(*config.Config)) (*Daemon, *logBuf) {
	tb.Helper()
	cfg := config.DefaultConfig()
	cfg.Node.DataDir = tb.TempDir()
	cfg.Node.Name = "test"
	cfg.MQTT.Listen = "127.0.0.1:0"
	cfg.HTTP.Listen = "127.0.0.1:0"
	cfg.Peer.Listen = "127.0.0.1:0"
	if mutate != nil {
		mutate(cfg)
	}
	logs := &logBuf{}
	d, err := New(cfg, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := d.Start(ctx); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { d.Stop() })
	return d, logs
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

// assertServingFrom is assertServing with clients connecting from the
// local address from.
func assertServingFrom(t *testing.T, d *Daemon, from, user, pass string) []storage.Record {
	t.Helper()
	o := connOpts{version: 5, id: "serving-" + fmt.Sprint(time.Now().UnixNano()), from: from}
	if user != "" {
		o.user, o.pass = ptr(user), ptr(pass)
	}
	sub := mustConnect(t, d.MQTTAddr(), o)
	if codes := sub.subscribe(1, "ok/#"); codes[0] >= 0x80 {
		t.Fatalf("subscribe ok/#: %x", codes)
	}
	o.id += "-pub"
	pub := mustConnect(t, d.MQTTAddr(), o)
	payload := "still serving " + o.id
	pub.pub("ok/check", 1, false, 7, nil, payload)
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
	if n := countTopic(t, d, "ok/check"); n == 0 {
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
	if n := logs.count("bad user name or password"); n != 1 {
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

func aclGateway(t *testing.T) (*Daemon, *logBuf) {
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
	if logs.count("publish denied by ACL") != 1 {
		t.Errorf("three refused publishes logged %d times, want once:\n%s", logs.count("publish denied by ACL"), logs)
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
	waitFor(t, 5*time.Second, "one client", func() bool { return d.broker.Clients() == 1 })
	acl := d.live.MQTT.ACLFile
	writeFile(t, acl, strings.Replace(aclText, "topic readwrite alice/#\n", "topic readwrite alice/#\ntopic deny alice/will\n", 1))
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	w.Close() // no DISCONNECT: the will would fire
	waitFor(t, 5*time.Second, "the disconnect", func() bool { return d.broker.Clients() == 0 })
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

// ---------------------------------------------------------------------------
// TLS.

// testPKI is a CA, a server certificate for 127.0.0.1 and client
// certificates: good, expired, and one from a CA the gateway does not trust.
type testPKI struct {
	caFile, certFile, keyFile string
	ca                        *x509.CertPool
	good, expired, untrusted  tls.Certificate
}

func newTestPKI(t *testing.T, dir string) *testPKI {
	t.Helper()
	caCert, caKey := newCA(t, "tandem test CA")
	otherCA, otherKey := newCA(t, "someone else's CA")
	now := time.Now()
	p := &testPKI{ca: x509.NewCertPool()}
	p.ca.AddCert(caCert)
	p.caFile = writeFile(t, filepath.Join(dir, "ca.pem"), string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caCert.Raw})))
	server := leaf(t, "gateway", caCert, caKey, now.Add(-time.Hour), now.Add(time.Hour), true)
	p.certFile = writeFile(t, filepath.Join(dir, "server.pem"), string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: server.Certificate[0]})))
	kb, err := x509.MarshalECPrivateKey(server.PrivateKey.(*ecdsa.PrivateKey))
	if err != nil {
		t.Fatal(err)
	}
	p.keyFile = writeFile(t, filepath.Join(dir, "server.key"), string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})))
	p.good = leaf(t, "sensor-1", caCert, caKey, now.Add(-time.Hour), now.Add(time.Hour), false)
	p.expired = leaf(t, "sensor-1", caCert, caKey, now.Add(-48*time.Hour), now.Add(-24*time.Hour), false)
	p.untrusted = leaf(t, "sensor-1", otherCA, otherKey, now.Add(-time.Hour), now.Add(time.Hour), false)
	return p
}

func newCA(t *testing.T, name string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-72 * time.Hour), NotAfter: time.Now().Add(72 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c, key
}

func leaf(t *testing.T, cn string, ca *x509.Certificate, caKey *ecdsa.PrivateKey, from, until time.Time, server bool) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: from, NotAfter: until, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// dialTLS opens a TLS connection with the client certificate given (none
// when cert is nil). The handshake error, if any, is returned: with TLS 1.3
// a refused client certificate may only show on the first read.
func dialTLS(t *testing.T, addr string, ca *x509.CertPool, cert *tls.Certificate) (*tls.Conn, error) {
	t.Helper()
	conf := &tls.Config{RootCAs: ca, ServerName: "127.0.0.1"}
	if cert != nil {
		conf.Certificates = []tls.Certificate{*cert}
	}
	d := &net.Dialer{Timeout: 5 * time.Second}
	conn, err := tls.DialWithDialer(d, "tcp", addr, conf)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { conn.Close() })
	return conn, nil
}

func TestTLSClientCertificates(t *testing.T) {
	dir := t.TempDir()
	pki := newTestPKI(t, dir)
	acl := writeFile(t, filepath.Join(dir, "acl"), "topic readwrite ok/#\nuser sensor-1\ntopic readwrite sensors/sensor-1/#\n")
	d, logs := startGateway(t, func(c *config.Config) {
		c.MQTT.TLS = config.TLSConfig{Listen: "127.0.0.1:0", CertFile: pki.certFile, KeyFile: pki.keyFile, CAFile: pki.caFile,
			RequireClientCert: true, UseIdentityAsUsername: true}
		c.MQTT.ACLFile = acl
	})
	addr := d.MQTTTLSAddr()
	if addr == "" {
		t.Fatal("no TLS listener")
	}

	t.Run("valid certificate, its common name is the user", func(t *testing.T) {
		conn, err := dialTLS(t, addr, pki.ca, &pki.good)
		if err != nil {
			t.Fatal(err)
		}
		if v := conn.ConnectionState().Version; v < tls.VersionTLS12 {
			t.Fatalf("TLS version %#x", v)
		}
		c, ca := mqttOn(t, conn, connOpts{version: 5, id: "cert-client"})
		if ca.closed || ca.code != 0 {
			t.Fatalf("CONNACK %+v", ca)
		}
		c.pub("sensors/sensor-1/t", 1, false, 1, nil, "21.5")
		if r := c.ack(0x40, 1); r != 0 {
			t.Fatalf("own topic: PUBACK %#x", r)
		}
		c.pub("sensors/sensor-2/t", 1, false, 2, nil, "spoof")
		if r := c.ack(0x40, 2); r != 0x87 {
			t.Fatalf("another sensor's topic: PUBACK %#x, want 0x87", r)
		}
	})
	for _, tt := range []struct {
		name string
		cert *tls.Certificate
	}{{"expired certificate", &pki.expired}, {"untrusted certificate", &pki.untrusted}, {"no certificate", nil}} {
		t.Run(tt.name, func(t *testing.T) {
			conn, err := dialTLS(t, addr, pki.ca, tt.cert)
			if err == nil {
				// TLS 1.3: the server's verdict comes with the first read.
				conn.SetDeadline(time.Now().Add(5 * time.Second))
				conn.Write([]byte{0x10, byte(len(connectBody(connOpts{version: 4, id: "bad"})))})
				conn.Write(connectBody(connOpts{version: 4, id: "bad", keepAlive: 60}))
				var b [1]byte
				_, err = conn.Read(b[:])
			}
			if err == nil {
				t.Fatal("the gateway answered a client with a bad certificate")
			}
			if !strings.Contains(err.Error(), "tls") && !strings.Contains(err.Error(), "reset") && err != io.EOF {
				t.Fatalf("unexpected error: %v", err)
			}
		})
	}
	waitFor(t, 5*time.Second, "the handshake failures to be logged", func() bool { return logs.count("TLS handshake failed") >= 1 })
	if n := logs.count("TLS handshake failed"); n != 1 {
		t.Errorf("3 failed handshakes from one address logged %d times, want once a minute", n)
	}
	// The plain listener (loopback, anonymous) and the log are unharmed.
	recs := assertServing(t, d, "", "")
	noRecordFrom(t, recs, "bad")
	if n := countTopic(t, d, "sensors/sensor-1/t"); n != 1 {
		t.Fatalf("the certificate client's publish is in the log %d times", n)
	}
}

// ---------------------------------------------------------------------------
// Limits.

func TestOversizePacketDisconnectsOnlyItsClient(t *testing.T) {
	d, logs := startGateway(t, func(c *config.Config) { c.MQTT.MaxPacketSize = 2 << 10 })
	for _, version := range []byte{5, 4} {
		c := mustConnect(t, d.MQTTAddr(), connOpts{version: version, id: fmt.Sprint("big", version)})
		c.pub("ok/small", 1, false, 1, nil, strings.Repeat("s", 1000))
		if r := c.ack(0x40, 1); r != 0 {
			t.Fatalf("a packet under the limit: PUBACK %#x", r)
		}
		c.pub("ok/big", 1, false, 2, nil, strings.Repeat("b", 3000))
		c.expectClosed()
	}
	// MQTT 5 clients are told the limit.
	_, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "told"})
	if ca.props == nil || ca.props.MaximumPacketSize == nil || *ca.props.MaximumPacketSize != 2<<10 {
		t.Fatalf("CONNACK does not carry the maximum packet size: %+v", ca.props)
	}
	waitFor(t, 5*time.Second, "the refusal to be logged", func() bool { return logs.count("packet larger than max_packet_size") == 1 })
	if countTopic(t, d, "ok/big") != 0 {
		t.Fatal("an oversize publish reached the log")
	}
	assertServing(t, d, "", "")
}

// dialFrom connects from a given loopback address, so that a test can be
// another source than the flood it causes.
func dialFrom(t *testing.T, local, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

func TestConnectionFloodFromOneAddressRefused(t *testing.T) {
	d, logs := startGateway(t, func(c *config.Config) {
		c.MQTT.ConnectRate = 0.1 // one every 10 s, after the burst
		c.MQTT.ConnectBurst = 5
	})
	established := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "established"}) // takes 1 of the burst
	accepted, refused := 0, 0
	for i := 0; i < 20; i++ {
		conn := dialFrom(t, "127.0.0.1", d.MQTTAddr())
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		body := connectBody(connOpts{version: 5, id: fmt.Sprint("flood-", i), keepAlive: 60})
		conn.Write(append([]byte{0x10, byte(len(body))}, body...))
		var b [4]byte
		if n, err := io.ReadAtLeast(conn, b[:], 4); err == nil && n >= 4 && b[0] == 0x20 && b[3] == 0 {
			accepted++
		} else {
			refused++
		}
		conn.Close()
	}
	if accepted > 5 || refused < 15 {
		t.Fatalf("%d accepted, %d refused from one address; want the burst of 4 more, then refusals", accepted, refused)
	}
	if n := logs.count("connection rate exceeded"); n != 1 {
		t.Errorf("%d refused connections logged %d times, want once a minute:\n%s", refused, n, logs)
	}
	// The established client is served.
	established.pub("ok/established", 1, false, 1, nil, "x")
	if r := established.ack(0x40, 1); r != 0 {
		t.Fatalf("established client: PUBACK %#x", r)
	}
	// Another address is not limited by this one's flood.
	other := dialFrom(t, "127.0.0.2", d.MQTTAddr())
	c, ca := mqttOn(t, other, connOpts{version: 5, id: "other-address"})
	if ca.closed || ca.code != 0 {
		t.Fatalf("a client from another address: %+v", ca)
	}
	c.pub("ok/other", 1, false, 1, nil, "x")
	if r := c.ack(0x40, 1); r != 0 {
		t.Fatalf("other address: PUBACK %#x", r)
	}
	if err := d.Err(); err != nil {
		t.Fatal(err)
	}
	if countTopic(t, d, "ok/other") != 1 || countTopic(t, d, "ok/established") != 1 {
		t.Fatal("acked publishes missing from the log")
	}
}

func TestTopicLimits(t *testing.T) {
	d, logs := startGateway(t, func(c *config.Config) {
		c.MQTT.MaxTopicLength = 32
		c.MQTT.MaxTopicLevels = 4
	})
	long := strings.Repeat("x", 33)
	deep := "a/b/c/d/e"
	for _, topic := range []string{long, deep} {
		c5 := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "t5"})
		c5.pub(topic, 1, false, 1, nil, "x")
		if r := c5.expectClosed(); r != 0x90 {
			t.Fatalf("MQTT 5 publish to %q: DISCONNECT %#x, want 0x90 topic name invalid", topic, r)
		}
		c3 := mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "t3"})
		c3.pub(topic, 1, false, 1, nil, "x")
		c3.expectClosed()
	}
	for _, tt := range []struct {
		version, refused byte
	}{{5, 0x8f}, {4, 0x80}} {
		c := mustConnect(t, d.MQTTAddr(), connOpts{version: tt.version, id: fmt.Sprint("s", tt.version)})
		got := c.subscribe(1, "ok/#", deep, "a/b/c/#", long)
		if want := []byte{1, tt.refused, 1, tt.refused}; !bytes.Equal(got, want) {
			t.Fatalf("version %d: SUBACK %x, want %x", tt.version, got, want)
		}
		c.pub("ok/after", 1, false, 2, nil, "x")
		if typ, _ := c.read(); typ&0xf0 != 0x30 && typ != 0x40 {
			t.Fatalf("after a refused filter the client is not served: %#x", typ)
		}
	}
	// A will whose topic is over the limits is refused at CONNECT.
	_, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "w5", willTopic: deep})
	if ca.closed || ca.code != 0x90 {
		t.Fatalf("MQTT 5 will over the limits: %+v, want CONNACK 0x90", ca)
	}
	c3, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 4, id: "w3", willTopic: long})
	if !ca.closed {
		t.Fatalf("3.1.1 will over the limits: %+v, want the connection closed (no CONNACK code fits)", ca)
	}
	c3.Close()
	if logs.count("topic deeper than max_topic_levels: disconnected") != 1 {
		t.Errorf("two publishes over the level limit from one address logged %d times, want once", logs.count("topic deeper than max_topic_levels: disconnected"))
	}
	for _, r := range assertServing(t, d, "", "") {
		if r.Topic == long || r.Topic == deep {
			t.Fatalf("a topic over the limits reached the log: %s", r.Topic)
		}
	}
}

func TestKeepAliveBounds(t *testing.T) {
	d, _ := startGateway(t, func(c *config.Config) {
		c.MQTT.KeepAliveMin = config.Duration(10 * time.Second)
		c.MQTT.KeepAliveMax = config.Duration(120 * time.Second)
	})
	for _, tt := range []struct {
		version byte
		ka      uint16
		code    byte
		server  uint16 // server keep alive in the CONNACK, 0 for none
	}{
		{5, 60, 0, 0},
		{5, 0, 0, 120},
		{5, 600, 0, 120},
		{5, 2, 0, 10},
		{4, 60, 0, 0},
		{4, 600, 0x02, 0},
		{4, 0, 0x02, 0},
		{4, 2, 0x02, 0},
	} {
		conn, err := net.DialTimeout("tcp", d.MQTTAddr(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		_, ca := mqttOnKA(t, conn, connOpts{version: tt.version, id: fmt.Sprint("ka", tt.version, "-", tt.ka), keepAlive: tt.ka})
		if ca.closed || ca.code != tt.code {
			t.Errorf("version %d keep-alive %d: %+v, want CONNACK %#x", tt.version, tt.ka, ca, tt.code)
			continue
		}
		var server uint16
		if ca.props != nil && ca.props.ServerKeepAlive != nil {
			server = *ca.props.ServerKeepAlive
		}
		if server != tt.server {
			t.Errorf("version %d keep-alive %d: server keep alive %d, want %d", tt.version, tt.ka, server, tt.server)
		}
	}
	assertServing(t, d, "", "")
}

func TestMaxClients(t *testing.T) {
	d, _ := startGateway(t, func(c *config.Config) { c.MQTT.MaxClients = 3 })
	a := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "a"})
	mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "b"})
	mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "c"})
	waitFor(t, 5*time.Second, "3 clients", func() bool { return d.broker.Clients() == 3 })
	for _, tt := range []struct{ version, code byte }{{5, 0x89}, {4, 0x03}} {
		c, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: tt.version, id: "one-too-many"})
		if ca.closed || ca.code != tt.code {
			t.Fatalf("version %d: %+v, want CONNACK %#x", tt.version, ca, tt.code)
		}
		c.expectClosed()
	}
	a.pub("ok/a", 1, false, 1, nil, "x")
	if r := a.ack(0x40, 1); r != 0 {
		t.Fatalf("PUBACK %#x", r)
	}
}

// Stopping while clients leave must not hang. mochi's own way of closing a
// listener's clients read-locks its client map twice and deadlocks with a
// client removing itself in between (seen once in ~100 loaded runs of this
// file); the listener no longer goes that way. The window is too narrow for
// this test to hit reliably: it checks the shutdown path, not the race.
func TestStopWhileClientsLeave(t *testing.T) {
	for round := 0; round < 5; round++ {
		d, _ := startGateway(t, nil)
		var conns []*mqttConn
		for i := 0; i < 40; i++ {
			conns = append(conns, mustConnect(t, d.MQTTAddr(), connOpts{version: byte(4 + i%2), id: fmt.Sprint("leaver-", i)}))
		}
		stopped := make(chan struct{})
		go func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		go func() {
			d.Stop()
			close(stopped)
		}()
		select {
		case <-stopped:
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: Stop hangs while clients disconnect", round)
		}
	}
}

// ---------------------------------------------------------------------------
// Reload.

// reloadGateway starts a gateway from a config file, as `tandem run
// --config` does, so that Reload re-reads it.
func reloadGateway(t *testing.T, dir, yaml string) (*Daemon, *logBuf) {
	t.Helper()
	path := writeFile(t, filepath.Join(dir, "tandem.yaml"), yaml)
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return startGateway(t, func(c *config.Config) {
		cfg.Node, cfg.HTTP, cfg.Peer = c.Node, c.HTTP, c.Peer
		cfg.MQTT.Listen = c.MQTT.Listen
		*c = *cfg
	})
}

func TestReloadChangesAccessWithoutRestart(t *testing.T) {
	dir := t.TempDir()
	users := usersFile(t, filepath.Join(dir, "users"), "alice", "a", "bob", "b")
	acl := writeFile(t, filepath.Join(dir, "acl"), "user alice\ntopic readwrite alice/#\ntopic read news/#\nuser bob\ntopic readwrite #\n")
	const after = "user alice\ntopic readwrite alice/#\ntopic write bob/#\nuser bob\ntopic readwrite #\nuser carol\ntopic readwrite carol/#\ntopic readwrite ok/#\n"
	d, logs := reloadGateway(t, dir, fmt.Sprintf("mqtt:\n  users_file: %s\n  acl_file: %s\n", users, acl))

	alice := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "alice", user: ptr("alice"), pass: ptr("a")})
	aliceSub, got := v5Auth(t, d.MQTTAddr(), "alice-sub", "alice", "a")
	subscribe(t, aliceSub, "news/#", 1)
	subscribe(t, aliceSub, "alice/#", 1)
	bob := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "bob", user: ptr("bob"), pass: ptr("b")})
	alice.pub("bob/x", 1, false, 1, nil, "x")
	if r := alice.ack(0x40, 1); r != 0x87 {
		t.Fatalf("before the reload: PUBACK %#x, want 0x87", r)
	}
	if _, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "carol", user: ptr("carol"), pass: ptr("c")}); ca.code != 0x86 {
		t.Fatalf("carol before she is added: %+v", ca)
	}

	// New rules: alice may write bob/#, but no longer read news/#; carol
	// is added; bob is removed.
	writeFile(t, acl, after)
	usersFile(t, users, "alice", "a", "carol", "c")
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	alice.pub("bob/x", 1, false, 2, nil, "now allowed")
	if r := alice.ack(0x40, 2); r != 0 {
		t.Fatalf("after the reload, on the same connection: PUBACK %#x, want 0", r)
	}
	carol := mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "carol", user: ptr("carol"), pass: ptr("c")})
	carol.pub("carol/1", 1, false, 1, nil, "x")
	carol.expect(0x40, 1)
	if _, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "bob2", user: ptr("bob"), pass: ptr("b")}); ca.code != 0x86 {
		t.Fatalf("bob after his removal: %+v, want CONNACK 0x86", ca)
	}
	// bob's connection stayed up: the reload drops no connection.
	bob.pub("news/1", 1, false, 1, nil, "not for alice any more")
	if r := bob.ack(0x40, 1); r != 0 {
		t.Fatalf("bob's open connection: PUBACK %#x", r)
	}
	bob.pub("alice/marker", 1, false, 2, nil, "marker")
	bob.ack(0x40, 2)
	// Delivery to one client is in order: news/1 would come before the
	// marker.
	if p := receive(t, got, 5*time.Second); p.Topic != "alice/marker" {
		t.Fatalf("alice's subscription delivered %s after the reload took news/# away", p.Topic)
	}

	// A broken file: the reload fails with its line, the rules in force
	// stay.
	writeFile(t, acl, "user alice\ntopic readwrite alice/#\ntopik write bob/#\n")
	err := d.Reload()
	if err == nil || !strings.Contains(err.Error(), acl+":3") {
		t.Fatalf("reload of a broken ACL: %v, want an error naming %s:3", err, acl)
	}
	alice.pub("bob/y", 1, false, 3, nil, "still allowed")
	if r := alice.ack(0x40, 3); r != 0 {
		t.Fatalf("after a failed reload: PUBACK %#x, want the previous rules (0)", r)
	}
	writeFile(t, users, "alice:not-a-hash\n")
	if err := d.Reload(); err == nil || !strings.Contains(err.Error(), users+":1") {
		t.Fatalf("reload of a broken users file: %v", err)
	}
	if _, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "carol2", user: ptr("carol"), pass: ptr("c")}); ca.code != 0 {
		t.Fatalf("after a failed reload carol is refused: %+v", ca)
	}
	if !strings.Contains(logs.String(), "read denied by ACL") {
		t.Error("the refused delivery was not logged")
	}
	assertServing(t, d, "carol", "c")
}

// The topic rules are reloaded too: a topic turned sync is refused after
// sync_timeout on a lone gateway, without a restart.
func TestReloadTopicRules(t *testing.T) {
	dir := t.TempDir()
	base := "cluster:\n  sync_timeout: 200ms\ntopics:\n  - match: alarms/#\n    ack: %s\n"
	d, _ := reloadGateway(t, dir, fmt.Sprintf(base, "async"))
	c := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "alarm"})
	c.pub("alarms/1", 1, false, 1, nil, "x")
	if r := c.ack(0x40, 1); r != 0 {
		t.Fatalf("async alarm: PUBACK %#x", r)
	}
	writeFile(t, filepath.Join(dir, "tandem.yaml"), fmt.Sprintf(base, "sync"))
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	c.pub("alarms/2", 1, false, 2, nil, "x")
	if r := c.ack(0x40, 2); r != 0x80 {
		t.Fatalf("after turning alarms/# sync on a lone gateway: PUBACK %#x, want 0x80", r)
	}
	// A broken config is refused whole.
	writeFile(t, filepath.Join(dir, "tandem.yaml"), "topics:\n  - match: a/#/b\n    ack: sync\n")
	if err := d.Reload(); err == nil || !strings.Contains(err.Error(), "topics[0].match") {
		t.Fatalf("reload of a broken config: %v", err)
	}
}

// A real SIGHUP to `tandem run` changes access without a restart.
func TestSIGHUPReloadsRunningDaemon(t *testing.T) {
	dir := t.TempDir()
	users := usersFile(t, filepath.Join(dir, "users"), "alice", "a")
	acl := writeFile(t, filepath.Join(dir, "acl"), "user alice\ntopic readwrite alice/#\n")
	mqttAddr, httpAddr := freePort(t), freePort(t)
	cfgPath := writeFile(t, filepath.Join(dir, "tandem.yaml"), fmt.Sprintf(
		"node:\n  data_dir: %s\nmqtt:\n  listen: %s\n  users_file: %s\n  acl_file: %s\nhttp:\n  listen: %s\npeer:\n  listen: 127.0.0.1:0\n",
		filepath.Join(dir, "data"), mqttAddr, users, acl, httpAddr))
	cmd := exec.Command(os.Args[0], "run", "--config", cfgPath)
	cmd.Env = append(os.Environ(), ChildEnv+"=1")
	out := &logBuf{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Kill() // by its own pid
		<-exited
		if t.Failed() {
			t.Logf("tandem output:\n%s", out)
		}
	})
	waitFor(t, 30*time.Second, "tandem to serve", func() bool {
		select {
		case <-exited:
			t.Fatalf("tandem exited: %s", out)
		default:
		}
		resp, err := (&http.Client{Timeout: time.Second}).Get("http://" + httpAddr + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	c := mustConnect(t, mqttAddr, connOpts{version: 5, id: "alice", user: ptr("alice"), pass: ptr("a")})
	c.pub("shared/1", 1, false, 1, nil, "x")
	if r := c.ack(0x40, 1); r != 0x87 {
		t.Fatalf("before SIGHUP: PUBACK %#x, want 0x87", r)
	}
	writeFile(t, acl, "user alice\ntopic readwrite alice/#\ntopic write shared/#\n")
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the reload to be logged", func() bool { return strings.Contains(out.String(), "reloaded users, ACLs and topic rules") })
	c.pub("shared/2", 1, false, 2, nil, "x")
	if r := c.ack(0x40, 2); r != 0 {
		t.Fatalf("after SIGHUP, same connection: PUBACK %#x, want 0", r)
	}
	select {
	case <-exited:
		t.Fatal("tandem exited on SIGHUP")
	default:
	}
}

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// ---------------------------------------------------------------------------
// Config.

func TestSecurityConfigValidation(t *testing.T) {
	for _, tt := range []struct{ yaml, key, contains string }{
		{"mqtt:\n  allow_anonymous: true\n  tls:\n    cert_file: /c\n", "mqtt.tls.key_file", "missing"},
		{"mqtt:\n  tls:\n    key_file: /k\n", "mqtt.tls.key_file", "without mqtt.tls.cert_file"},
		{"mqtt:\n  allow_anonymous: true\n  tls:\n    cert_file: /c\n    key_file: /k\n    require_client_cert: true\n", "mqtt.tls.require_client_cert", "ca_file"},
		{"mqtt:\n  allow_anonymous: true\n  tls:\n    cert_file: /c\n    key_file: /k\n    use_identity_as_username: true\n", "mqtt.tls.use_identity_as_username", "require_client_cert"},
		{"mqtt:\n  allow_anonymous: true\n  tls:\n    cert_file: /c\n    key_file: /k\n    min_version: \"1.1\"\n", "mqtt.tls.min_version", "not one of"},
		{"mqtt:\n  tls:\n    cert_file: /c\n    key_file: /k\n", "mqtt.tls.listen", "requires users"},
		{"mqtt:\n  max_packet_size: 100B\n", "mqtt.max_packet_size", "out of range"},
		{"mqtt:\n  max_packet_size: 1GiB\n", "mqtt.max_packet_size", "out of range"},
		{"mqtt:\n  max_topic_length: 70000\n", "mqtt.max_topic_length", "out of range"},
		{"mqtt:\n  connect_rate: -1\n", "mqtt.connect_rate", "out of range"},
		{"mqtt:\n  connect_rate: fast\n", "mqtt.connect_rate", "is not a number"},
		{"mqtt:\n  keepalive_max: 1500ms\n", "mqtt.keepalive_max", "whole number of seconds"},
		{"mqtt:\n  keepalive_max: 20h\n", "mqtt.keepalive_max", "at most 65535s"},
		{"mqtt:\n  keepalive_min: 2m\n  keepalive_max: 1m\n", "mqtt.keepalive_min", "more than mqtt.keepalive_max"},
	} {
		_, err := config.Parse([]byte(tt.yaml), "t.yaml")
		var ce *config.ConfigError
		if !errors.As(err, &ce) || ce.Key != tt.key || ce.Line == 0 || !strings.Contains(err.Error(), tt.contains) {
			t.Errorf("%q: %v, want key %s with a line, and %q", tt.yaml, err, tt.key, tt.contains)
		}
	}
	// TLS on by its certificate alone, with the default port; a listener
	// that requires client certificates needs no users file.
	c, err := config.Parse([]byte("mqtt:\n  tls:\n    cert_file: /c\n    key_file: /k\n    ca_file: /ca\n    require_client_cert: true\n"), "t.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.MQTT.TLS.Listen != ":8883" || c.MQTT.TLS.MinVersion != "1.2" {
		t.Fatalf("TLS defaults: %+v", c.MQTT.TLS)
	}
}

// A users file that cannot be read stops the start with exit 2 and its
// name, as a bad config does.
func TestBadSecurityFilesRefusedAtStart(t *testing.T) {
	dir := t.TempDir()
	bad := writeFile(t, filepath.Join(dir, "users"), "alice\n")
	cfg := writeFile(t, filepath.Join(dir, "tandem.yaml"), fmt.Sprintf("mqtt:\n  users_file: %s\n", bad))
	code, _, stderr := runMain(t, append(runArgs(filepath.Join(dir, "data")), "--config", cfg)...)
	if code != ExitUsage || !strings.Contains(stderr, bad+":1") {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	cfg = writeFile(t, filepath.Join(dir, "tandem.yaml"), "mqtt:\n  allow_anonymous: true\n  tls:\n    listen: 127.0.0.1:0\n    cert_file: /nonexistent/c.pem\n    key_file: /nonexistent/k.pem\n")
	code, _, stderr = runMain(t, append(runArgs(filepath.Join(dir, "data")), "--config", cfg)...)
	if code != ExitUsage || !strings.Contains(stderr, "/nonexistent/c.pem") {
		t.Fatalf("exit %d: %s", code, stderr)
	}
}

// ---------------------------------------------------------------------------
// Fuzzing the inbound path.

// FuzzInboundStream feeds arbitrary bytes to a gateway as a client's
// stream, then checks that another client is served (a publish and its
// PUBACK) and that the log still decodes. One gateway serves every input of
// a fuzzing process.
func FuzzInboundStream(f *testing.F) {
	d, _ := startGateway(f, func(c *config.Config) {
		c.MQTT.ConnectRate = 1e9 // the fuzzer connects far faster than any device
		c.MQTT.ConnectBurst = 1 << 30
		c.MQTT.MaxPacketSize = 64 << 10
		c.MQTT.MaxTopicLevels = 8
	})
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	var mu sync.Mutex // guards next and n: the fuzzer may run inputs in parallel
	next, n := uint64(1), 0
	f.Fuzz(func(t *testing.T, data []byte) {
		conn, err := net.DialTimeout("tcp", d.MQTTAddr(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		conn.Write(data)
		// EOF after the input: the gateway reads all of it, then hangs up.
		conn.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, conn)
		conn.Close()

		mu.Lock()
		n++
		id := fmt.Sprintf("fuzz-check-%d", n)
		mu.Unlock()
		c, _ := dialVersion(t, d.MQTTAddr(), id, true, 4)
		c.pub("fuzz/check", 1, false, 1, nil, id)
		c.expect(0x40, 1)
		c.Close()
		if err := d.Err(); err != nil {
			t.Fatalf("the node failed: %v", err)
		}
		mu.Lock()
		defer mu.Unlock()
		from := next
		err = d.db.Scan(from, func(e pbEntry) bool {
			if e.Type == 0 && len(e.Data) > 0 {
				if _, derr := storage.DecodeRecord(e.Data); derr != nil {
					t.Errorf("entry %d: %v", e.Index, derr)
					return false
				}
			}
			next = e.Index + 1
			return true
		})
		if err != nil {
			t.Fatal(err)
		}
	})
}

// fuzzSeeds are client streams worth mutating: valid sessions of both
// protocol versions and the usual kinds of malformation.
func fuzzSeeds() [][]byte {
	frame := mqttFrame
	v3 := frame(0x10, connectBody(connOpts{version: 4, id: "f3", keepAlive: 30}))
	v5 := frame(0x10, connectBody(connOpts{version: 5, id: "f5", keepAlive: 30}))
	will := frame(0x10, connectBody(connOpts{version: 4, id: "fw", keepAlive: 30, willTopic: "fuzz/will"}))
	pub3 := frame(0x32, append(appendMQTTString(nil, "fuzz/a"), 0, 1, 'x'))
	pub5 := frame(0x34, append(appendMQTTString(nil, "fuzz/b"), 0, 2, 3, 0x23, 0, 1, 'y')) // QoS 2, topic alias 1
	alias := frame(0x32, append(appendMQTTString(nil, ""), 0, 3, 3, 0x23, 0, 1, 'z'))
	pubrel := frame(0x62, []byte{0, 2, 0, 0})
	sub3 := frame(0x82, append(appendMQTTString([]byte{0, 4}, "fuzz/#"), 1))
	sub5 := frame(0x82, append(appendMQTTString([]byte{0, 5, 0}, "$share/g/fuzz/#"), 2))
	unsub := frame(0xa2, appendMQTTString([]byte{0, 6}, "fuzz/#"))
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	return [][]byte{
		cat(v3, pub3, sub3, unsub, []byte{0xc0, 0}, []byte{0xe0, 0}),
		cat(v5, pub5, pubrel, alias, sub5, []byte{0xe0, 0}),
		cat(will, pub3),
		cat(v3, pub3, pub3), // same packet id twice
		cat(v3, []byte{0x32, 0xff, 0xff, 0xff, 0x7f}),     // remaining length at the maximum
		cat(v3, []byte{0x30 | 6, 0x05, 0xff, 0xff, 1, 2}), // QoS 3, topic past the end
		cat(v3, v3), // a second CONNECT
		pub3,        // PUBLISH before CONNECT
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
		{0x10, 0x80, 0x80, 0x80, 0x80, 0x01}, // a length of five bytes
		{},
	}
}
