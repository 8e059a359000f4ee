package config

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// A file with several mistakes gets them all at once, each naming its key
// and line: unknown keys, values of the wrong type, broken rules, two
// listeners on one port.
func TestParseReportsEveryError(t *testing.T) {
	const yaml = `mqtt:
  listen: "0.0.0.0:1883"
  allow_anonymous: true
  listn: "x"
cluster:
  sync_timeout: 5
  failover: sometimes
http:
  listen: "127.0.0.1:1883"
log:
  level: loud
topics:
  - match: "a/#"
    ack: maybe
`
	c, err := Parse([]byte(yaml), "t.yaml")
	if c != nil {
		t.Error("Parse returned a Config with errors")
	}
	var list ErrorList
	if !errors.As(err, &list) {
		t.Fatalf("want an ErrorList, got %T %v", err, err)
	}
	want := map[string]int{
		"mqtt.listn":           4,
		"cluster.sync_timeout": 6,
		"cluster.failover":     7,
		"http.listen":          9,
		"log.level":            11,
		"topics[0].ack":        14,
	}
	got := map[string]int{}
	for _, e := range list {
		if e.File != "t.yaml" {
			t.Errorf("%v: file %q", e, e.File)
		}
		got[e.Key] = e.Line
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("errors (key: line)\n got %v\nwant %v\n%v", got, want, err)
	}
	var first *ConfigError
	if !errors.As(err, &first) || first.Key != "mqtt.listn" {
		t.Fatalf("errors.As gives %v, want the first error found", first)
	}
}

// Two listeners on one port are refused where their hosts overlap, not
// where they differ.
func TestListenersNeedTheirOwnPorts(t *testing.T) {
	for _, tc := range []struct {
		http, peer string
		bad        string
	}{
		{"127.0.0.1:7880", "127.0.0.1:7883", ""},
		{"127.0.0.1:1883", "127.0.0.1:7883", "http.listen"},
		{"127.0.0.2:1883", "127.0.0.1:7883", ""},
		{"127.0.0.1:7880", ":1883", "peer.listen"},
		{"127.0.0.1:0", "127.0.0.1:0", ""},
	} {
		c := DefaultConfig()
		c.MQTT.Listen, c.HTTP.Listen, c.Peer.Listen = "127.0.0.1:1883", tc.http, tc.peer
		err := c.Validate()
		var ce *ConfigError
		switch {
		case tc.bad == "" && err != nil:
			t.Errorf("%s %s: %v", tc.http, tc.peer, err)
		case tc.bad != "" && (!errors.As(err, &ce) || ce.Key != tc.bad):
			t.Errorf("%s %s: %v, want an error on %s", tc.http, tc.peer, err, tc.bad)
		}
	}
}

// `tandem check` lists the problems of a file in the order of its lines,
// whichever check found them (the walker's unknown keys and wrong types
// came first, then the rules, as 10, 4, 11, 7, 8, 14).
func TestProblemsAreReportedInLineOrder(t *testing.T) {
	const yaml = `mqtt:
  max_inflight: 0
  listn: x
log:
  level: loud
cluster:
  sync_timeout: 5
topics:
  - match: "a/#"
    ack: maybe
`
	_, err := Parse([]byte(yaml), "t.yaml")
	var list ErrorList
	if !errors.As(err, &list) {
		t.Fatalf("want an ErrorList, got %T %v", err, err)
	}
	var lines []int
	for _, e := range list {
		lines = append(lines, e.Line)
	}
	if fmt.Sprint(lines) != "[2 3 5 7 10]" {
		t.Fatalf("problems on lines %v, want [2 3 5 7 10]:\n%v", lines, err)
	}
}

// A 0 written in the file for a key whose range excludes it is refused,
// not taken for the default (mqtt.max_inflight: 0 passed as 1024); left
// out, the key gets its default, and where 0 means "off" it stays allowed.
func TestAnExplicitZeroIsRefusedNotDefaulted(t *testing.T) {
	for _, k := range []struct{ section, key string }{
		{"mqtt", "max_inflight"}, {"mqtt", "max_packet_size"}, {"mqtt", "max_clients"}, {"mqtt", "max_topic_length"},
		{"mqtt", "max_topic_levels"}, {"mqtt", "connect_rate"}, {"mqtt", "connect_burst"}, {"mqtt", "max_client_id_length"},
		{"mqtt", "max_connections_per_address"}, {"mqtt", "max_connections_per_user"}, {"mqtt", "max_filters_per_session"},
		{"mqtt", "max_retained"}, {"mqtt", "max_sessions"}, {"limits", "memory"}, {"peer", "max_strangers"},
		{"peer", "max_strangers_per_address"}, {"cluster", "failover_after"}, {"cluster", "sync_timeout"},
		{"cluster", "min_sync_replicas"}, {"cluster", "heartbeat"}, {"cluster", "election_timeout"},
		{"storage", "flush_interval"}, {"storage", "max_bytes"},
	} {
		key := k.section + "." + k.key
		_, err := Parse([]byte(k.section+":\n  "+k.key+": 0\n"), "t.yaml")
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Key != key || ce.Line != 2 || !strings.Contains(ce.Msg, "0 is out of range") {
			t.Errorf("%s: 0 gave %v, want refused as out of range on line 2", key, err)
		}
	}
	for _, ok := range []string{"mqtt:\n  keepalive_min: 0s\n  keepalive_max: 0s\n", "storage:\n  max_age: 0s\n", "mqtt:\n  max_queued: 0\n"} {
		if _, err := Parse([]byte(ok), "t.yaml"); err != nil {
			t.Errorf("%q: %v, want 0 accepted (off, or documented as the default)", ok, err)
		}
	}
	// A Config built in code: zero still means the default.
	c := &Config{}
	if err := c.Validate(); err != nil || c.MQTT.MaxInflight != 1024 {
		t.Fatalf("a zero Config: %v, max_inflight %d", err, c.MQTT.MaxInflight)
	}
}
