package config

import (
	"errors"
	"fmt"
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
