package daemon

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// ---------------------------------------------------------------------------
// Reload.

// reloadGateway starts a gateway from a config file, as `tandem run
// --config` does, so that Reload re-reads it.
func reloadGateway(t *testing.T, dir, yaml string) (*Daemon, *testutil.Buffer) {
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
	two := testutil.FreeAddrs(t, 2)
	mqttAddr, httpAddr := two[0], two[1]
	cfgPath := writeFile(t, filepath.Join(dir, "tandem.yaml"), fmt.Sprintf(
		"node:\n  data_dir: %s\nmqtt:\n  listen: %s\n  users_file: %s\n  acl_file: %s\nhttp:\n  listen: %s\npeer:\n  listen: 127.0.0.1:0\n",
		filepath.Join(dir, "data"), mqttAddr, users, acl, httpAddr))
	cmd := exec.Command(os.Args[0], "run", "--config", cfgPath)
	cmd.Env = append(os.Environ(), ChildEnv+"=1")
	out := &testutil.Buffer{}
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
	testutil.WaitFor(t, 30*time.Second, "tandem to serve", func() bool {
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
	testutil.WaitFor(t, 10*time.Second, "the reload to be logged", func() bool { return strings.Contains(out.String(), "reloaded users, ACLs and topic rules") })
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
