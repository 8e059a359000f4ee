package config

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

// configTestdata is shared with the other config tests at the module root.
func configTestdata(name string) string {
	return filepath.Join("..", "testdata", "config", name)
}

func TestDefaultConfig(t *testing.T) {
	c := DefaultConfig()
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "tandem"
	}
	want := &Config{
		Node: NodeConfig{Name: host, DataDir: "./tandem-data"},
		MQTT: MQTTConfig{Listen: "127.0.0.1:1883", MaxInflight: 1024, MaxPacketSize: 1 << 20, MaxClients: 1000,
			MaxTopicLength: 1024, MaxTopicLevels: 32, ConnectRate: 20, ConnectBurst: 100, MaxClientIDLength: 256,
			MaxFiltersPerSession: 100, MaxConnectionsPerAddress: 64, MaxConnectionsPerUser: 64,
			MaxRetained: 10000, MaxSessions: 10000},
		Peer: PeerConfig{Listen: "127.0.0.1:7883", MaxStrangers: 64, MaxStrangersPerAddress: 2},
		HTTP: HTTPConfig{Listen: "127.0.0.1:7880"},
		Log:  LogConfig{Level: "info", Format: "text"},
		Cluster: ClusterConfig{
			Failover:        "manual",
			FailoverAfter:   Duration(10 * time.Second),
			SyncTimeout:     Duration(5 * time.Second),
			MinSyncReplicas: 1,
			Heartbeat:       Duration(100 * time.Millisecond),
			ElectionTimeout: Duration(time.Second),
		},
		Storage: StorageConfig{Flush: "always", FlushInterval: Duration(200 * time.Millisecond), MaxBytes: 256 << 20, OnDamage: "resync"},
		Limits:  LimitsConfig{Memory: DefaultMemory},
	}
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("DefaultConfig() =\n%+v\nwant\n%+v", c, want)
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("default config does not validate: %v", err)
	}
}

func TestConfigValidateFillsZeroFields(t *testing.T) {
	c := &Config{}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c, DefaultConfig()) {
		t.Fatalf("zero Config after Validate =\n%+v\nwant the defaults", c)
	}
}

func TestParseConfigEmptyMeansDefaults(t *testing.T) {
	for _, in := range []string{"", "\n", "# only a comment\n", "---\n", "~\n", "mqtt:\n", "cluster:\n  sync_timeout:\n", "topics: []\n"} {
		c, err := Parse([]byte(in), "tandem.yaml")
		if err != nil {
			t.Errorf("%q: %v", in, err)
			continue
		}
		c.Topics = nil // "topics: []" is an empty list, not nil
		if !reflect.DeepEqual(c, DefaultConfig()) {
			t.Errorf("%q gave\n%+v\nwant the defaults", in, c)
		}
	}
}

func fullConfig() *Config {
	return &Config{
		Node: NodeConfig{Name: "gw-1", DataDir: "/var/lib/tandem"},
		MQTT: MQTTConfig{
			Listen: "0.0.0.0:1883",
			TLS: TLSConfig{
				Listen:                "0.0.0.0:8883",
				CertFile:              "/etc/tandem/mqtt.crt",
				KeyFile:               "/etc/tandem/mqtt.key",
				CAFile:                "/etc/tandem/clients-ca.crt",
				RequireClientCert:     true,
				UseIdentityAsUsername: true,
				MinVersion:            "1.3",
			},
			UsersFile:                "/etc/tandem/users",
			ACLFile:                  "/etc/tandem/acl",
			MaxInflight:              4096,
			MaxPacketSize:            256 << 10,
			MaxClients:               200,
			MaxTopicLength:           256,
			MaxTopicLevels:           8,
			ConnectRate:              2.5,
			ConnectBurst:             10,
			KeepAliveMin:             Duration(10 * time.Second),
			KeepAliveMax:             Duration(time.Hour),
			MaxClientIDLength:        64,
			MaxConnectionsPerAddress: 32,
			MaxConnectionsPerUser:    8,

			MaxFiltersPerSession: 500,
			MaxRetained:          5000,
			MaxRetainedBytes:     16 << 20,
			MaxSessions:          2000,
			MaxSessionBytes:      16 << 20,
			MaxQueued:            2000,
			MaxQueuedBytes:       8 << 20,
			MaxInflightOut:       50,
			MaxInflightOutBytes:  2 << 20,
			QueueFull:            "disconnect",
			TopicAliasMaximum:    50,
			ReasonStrings:        "all",
			WebSocket:            WebSocketConfig{Listen: "0.0.0.0:8080", TLS: true, Origins: []string{"dash.example.com"}},
		},
		Peer: PeerConfig{Listen: "0.0.0.0:7884", Advertise: []string{"198.51.100.1:7884", "gw-1.local:7884"}, MaxStrangers: 128, MaxStrangersPerAddress: 3},
		HTTP: HTTPConfig{Listen: "127.0.0.1:7881", TokenFile: "/etc/tandem/http-token", AllowedHosts: []string{"gw-1.example.net"},
			MaxConns: 32, MaxConnsPerAddress: 4, IdleTimeout: Duration(5 * time.Second)},
		Log: LogConfig{Level: "debug", Format: "json"},
		Cluster: ClusterConfig{
			Failover:        "auto",
			FailoverAfter:   Duration(30 * time.Second),
			SyncTimeout:     Duration(2 * time.Second),
			MinSyncReplicas: 2,
			Heartbeat:       Duration(50 * time.Millisecond),
			ElectionTimeout: Duration(500 * time.Millisecond),
		},
		Storage: StorageConfig{
			Flush:         "interval",
			FlushInterval: Duration(20 * time.Millisecond),
			MaxBytes:      512 << 20,
			MaxAge:        Duration(168 * time.Hour),
			MinFree:       128 << 20,
			OnDamage:      "refuse",
		},
		Topics: []TopicRule{
			{Match: "alarms/#", Ack: "sync"},
			{Match: "meters/+/energy", Ack: "sync"},
			{Match: "#", Ack: "async"},
		},
		Discovery: DiscoveryConfig{MDNS: true, Interface: "eth0"},
		Uplinks: []UplinkConfig{{
			Name: "cloud", Broker: "tls://mqtt.example.com:8883", Protocol: "5", ClientID: "site7-gw",
			Username: "site7", PasswordFile: "/etc/tandem/cloud.password",
			TLS:         UplinkTLS{CAFile: "/etc/tandem/cloud-ca.pem", CertFile: "/etc/tandem/cloud.pem", KeyFile: "/etc/tandem/cloud.key"},
			Topics:      []UplinkTopic{{Match: "meters/#", RemotePrefix: "site7/", QoS: &one}},
			Downlink:    []UplinkDownlink{{Remote: "site7/cmd/#", LocalPrefix: "cloud/", QoS: &one}},
			MaxInflight: 64, Rate: 500, MaxBacklog: 256 << 20, OnFull: "refuse",
			KeepAlive: Duration(30 * time.Second), ReconnectMin: Duration(time.Second), ReconnectMax: Duration(2 * time.Minute),
		}},
		Limits: LimitsConfig{Memory: 192 << 20},
	}
}

// one is a QoS for the uplink rules of fullConfig.
var one = 1

func TestLoadConfigFull(t *testing.T) {
	c, err := Load(configTestdata("full.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	want := fullConfig()
	want.file = configTestdata("full.yaml") // what a reload reads again
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("full.yaml =\n%+v\nwant\n%+v", c, want)
	}
	// Every yaml key of Config must be in full.yaml, so it stays the
	// complete example.
	data, err := os.ReadFile(configTestdata("full.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range allConfigKeys(reflect.TypeFor[Config](), "") {
		leaf := key[strings.LastIndex(key, ".")+1:]
		if !strings.Contains(string(data), leaf+":") {
			t.Errorf("full.yaml lacks %s", key)
		}
	}
}

func allConfigKeys(t reflect.Type, path string) []string {
	var keys []string
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		key := strings.TrimPrefix(path+"."+name, ".")
		keys = append(keys, key)
		ft := f.Type
		if ft.Kind() == reflect.Slice {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct {
			keys = append(keys, allConfigKeys(ft, key)...)
		}
	}
	return keys
}

func TestConfigRoundTrip(t *testing.T) {
	want := fullConfig()
	data, err := yaml.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Parse(data, "marshalled")
	if err != nil {
		t.Fatalf("%v\n%s", err, data)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("round trip =\n%+v\nwant\n%+v\nYAML:\n%s", got, want, data)
	}
}

func TestLoadConfigMissingFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "nope.yaml")
	_, err := Load(path)
	var ce *ConfigError
	if !errors.As(err, &ce) || ce.File != path {
		t.Fatalf("err = %#v, want a *ConfigError naming %s", err, path)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("err = %v, want it to wrap fs.ErrNotExist", err)
	}
	if !strings.HasPrefix(err.Error(), path+": ") {
		t.Fatalf("err = %q, want it to start with the path", err)
	}
}

// wantConfigError checks err is a *ConfigError at line with key, whose
// text contains each of contains.
func wantConfigError(t *testing.T, err error, file string, line int, key string, contains ...string) {
	t.Helper()
	var ce *ConfigError
	if !errors.As(err, &ce) {
		t.Fatalf("err = %v (%T), want a *ConfigError", err, err)
	}
	var list ErrorList
	if errors.As(err, &list) {
		// Several problems, in line order: the one the case is about.
		for _, e := range list {
			if e.Key == key {
				ce = e
				break
			}
		}
	}
	if ce.File != file || ce.Line != line || ce.Key != key {
		t.Errorf("got File=%q Line=%d Key=%q, want %q, %d, %q (%v)", ce.File, ce.Line, ce.Key, file, line, key, err)
	}
	for _, s := range contains {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q lacks %q", err, s)
		}
	}
}

func TestParseConfigErrors(t *testing.T) {
	tests := []struct {
		name     string
		in       string
		line     int
		key      string
		contains []string
	}{
		{"unknown top-level key", "node:\n  name: a\nmqt:\n  listen: x\n", 3, "mqt",
			[]string{`tandem.yaml:3: unknown key "mqt" (did you mean "mqtt"?)`}},
		{"unknown nested key", "mqtt:\n  users_file: u\n\n  listn: 0.0.0.0:1883\n", 4, "mqtt.listn",
			[]string{`tandem.yaml:4: unknown key "mqtt.listn" (did you mean "mqtt.listen"?)`}},
		{"unknown key far from any", "cluster:\n  banana: 1\n", 2, "cluster.banana",
			[]string{`unknown key "cluster.banana"; cluster takes failover, `}},
		{"unknown key in a topic rule", "topics:\n  - match: a\n    ack: sync\n  - match: b\n    mode: sync\n", 5, "topics[1].mode",
			[]string{`unknown key "topics[1].mode"`}},
		{"duplicate key", "log:\n  level: info\n  level: debug\n", 3, "log.level",
			[]string{`tandem.yaml:3: duplicate key "log.level" (first at line 2)`}},
		{"section is a scalar", "mqtt: 1883\n", 1, "mqtt", []string{"expected a mapping of keys (listen, tls,", `got "1883"`}},
		{"list is a scalar", "peer:\n  advertise: 10.0.0.1:7883\n", 2, "peer.advertise", []string{"expected a list"}},
		{"string is a mapping", "node:\n  name:\n    first: gw\n", 3, "node.name", []string{"expected a string, got a mapping"}},
		{"wrong type bool", "discovery:\n  mdns: perhaps\n", 2, "discovery.mdns", []string{`"perhaps" is not true or false`}},
		{"wrong type int", "mqtt:\n  max_inflight: many\n", 2, "mqtt.max_inflight", []string{`"many" is not a whole number`}},
		{"fractional int", "mqtt:\n  max_inflight: 1.5\n", 2, "mqtt.max_inflight", []string{`"1.5" is not a whole number`}},
		{"bad duration", "cluster:\n  failover: manual\n  sync_timeout: soon\n", 3, "cluster.sync_timeout",
			[]string{`tandem.yaml:3: cluster.sync_timeout: "soon" is not a duration (e.g. 500ms, 5s, 10m)`}},
		{"bare integer duration", "cluster:\n\n  sync_timeout: 5\n", 3, "cluster.sync_timeout",
			[]string{`tandem.yaml:3: cluster.sync_timeout: "5" is not a duration (use a unit, e.g. 5s)`}},
		{"quoted bare integer duration", "storage:\n  max_age: \"90\"\n", 2, "storage.max_age", []string{`use a unit, e.g. 90s`}},
		{"negative duration", "cluster:\n  heartbeat: -100ms\n", 2, "cluster.heartbeat", []string{`"-100ms" is negative`}},
		{"duration is a list", "cluster:\n  heartbeat: [1s]\n", 2, "cluster.heartbeat", []string{"expected a duration (e.g. 5s), got a list"}},
		{"bad size", "storage:\n  max_bytes: lots\n", 2, "storage.max_bytes", []string{`"lots" is not a size`}},
		{"bad size unit", "storage:\n  max_bytes: 10 XB\n", 2, "storage.max_bytes", []string{`unknown unit "XB"`}},
		{"negative size", "storage:\n  max_bytes: -1GB\n", 2, "storage.max_bytes", []string{`"-1GB" is negative`}},
		{"size overflow", "storage:\n  max_bytes: 20000000TB\n", 2, "storage.max_bytes", []string{"too large"}},
		{"bad enum", "log:\n  format: xml\n", 2, "log.format", []string{`tandem.yaml:2: log.format: "xml" is not one of text, json`}},
		{"bad enum failover", "cluster:\n  failover: automatic\n", 2, "cluster.failover", []string{"manual, auto"}},
		{"bad enum on_damage", "storage:\n  flush: always\n  on_damage: wipe\n", 3, "storage.on_damage", []string{`tandem.yaml:3: storage.on_damage: "wipe" is not one of resync, refuse`}},
		{"bad filter #", "topics:\n  - match: a/#/b\n    ack: sync\n", 2, "topics[0].match", []string{`"a/#/b" is not an MQTT topic filter`, "'#'"}},
		{"bad filter +", "topics:\n  - match: a/b\n    ack: sync\n  - match: a/x+\n    ack: sync\n", 4, "topics[1].match", []string{"'+' must be a whole level"}},
		{"empty filter", "topics:\n  - match: \"\"\n    ack: sync\n", 2, "topics[0].match", []string{"empty"}},
		{"missing filter", "topics:\n  - ack: sync\n", 2, "topics[0].match", []string{"empty"}},
		{"bad ack", "topics:\n  - match: a/#\n    ack: maybe\n", 3, "topics[0].ack", []string{`"maybe" is not one of sync, async`}},
		{"missing ack", "topics:\n  - match: a/#\n", 2, "topics[0].ack", []string{"missing"}},
		{"duplicate topic", "topics:\n  - match: a/#\n    ack: sync\n  - match: a/#\n    ack: async\n", 4, "topics[1].match",
			[]string{`repeats topics[0] (line 2)`}},
		{"min_sync_replicas", "cluster:\n  min_sync_replicas: 3\n", 2, "cluster.min_sync_replicas", []string{"1 or 2"}},
		{"max_inflight range", "mqtt:\n  max_inflight: 70000\n", 2, "mqtt.max_inflight", []string{"1 to 65535"}},
		{"max_retained negative", "mqtt:\n  max_retained: -1\n", 2, "mqtt.max_retained", []string{"-1 is out of range"}},
		{"max_sessions negative", "mqtt:\n  max_sessions: -5\n", 2, "mqtt.max_sessions", []string{"-5 is out of range"}},
		{"max_retained_bytes over half the budget", "storage:\n  max_bytes: 64MiB\nmqtt:\n  max_retained_bytes: 40MiB\n", 4, "mqtt.max_retained_bytes",
			[]string{"more than half of storage.max_bytes"}},
		{"max_session_bytes over half the budget", "storage:\n  max_bytes: 64MiB\nmqtt:\n  max_session_bytes: 40MiB\n", 4, "mqtt.max_session_bytes",
			[]string{"more than half of storage.max_bytes"}},
		{"max_session_bytes with max_retained_bytes over 3/4 of the budget", "storage:\n  max_bytes: 64MiB\nmqtt:\n  max_retained_bytes: 32MiB\n  max_session_bytes: 20MiB\n", 5, "mqtt.max_session_bytes",
			[]string{"more than 3/4 of storage.max_bytes"}},
		{"max_inflight_out range", "mqtt:\n  max_inflight_out: 70000\n", 2, "mqtt.max_inflight_out", []string{"1 to 65535"}},
		{"subscriber bounds over half the memory", "mqtt:\n  max_queued_bytes: 200MiB\n", 2, "mqtt.max_queued_bytes", []string{"more than half of limits.memory"}},
		{"http max_conns negative", "http:\n  max_conns: -1\n", 2, "http.max_conns", []string{"-1 is out of range"}},
		{"http max_conns_per_address negative", "http:\n  max_conns_per_address: -8\n", 2, "http.max_conns_per_address", []string{"-8 is out of range"}},
		{"http idle_timeout negative", "http:\n  idle_timeout: -1s\n", 2, "http.idle_timeout", []string{`"-1s" is negative`}},
		{"election timeout", "cluster:\n  heartbeat: 200ms\n  election_timeout: 400ms\n", 3, "cluster.election_timeout",
			[]string{"400ms must be more than twice cluster.heartbeat (200ms)"}},
		{"election timeout default too short", "cluster:\n  heartbeat: 600ms\n", 2, "cluster.election_timeout", []string{"1s must be more than twice"}},
		{"listen not host:port", "http:\n  listen: 7880\n", 2, "http.listen", []string{`"7880" is not host:port`, `write ":7880"`}},
		{"listen bad port", "peer:\n  listen: \":99999\"\n", 2, "peer.listen", []string{`port "99999"`}},
		{"max_strangers range", "peer:\n  max_strangers: 1\n", 2, "peer.max_strangers", []string{"2 to 65536"}},
		{"max_strangers_per_address over the total", "peer:\n  max_strangers: 8\n  max_strangers_per_address: 9\n", 3, "peer.max_strangers_per_address",
			[]string{"1 to peer.max_strangers (8)"}},
		{"advertise without host", "peer:\n  advertise:\n    - 10.0.0.1:7883\n    - :7883\n", 4, "peer.advertise[1]", []string{"no host"}},
		{"anonymous on the network", "mqtt:\n  listen: 0.0.0.0:1883\n", 2, "mqtt.listen",
			[]string{"requires users", "mqtt.users_file", "mqtt.allow_anonymous: true"}},
		{"anonymous TLS on the network", "mqtt:\n  tls:\n    listen: :8883\n", 3, "mqtt.tls.listen", []string{"requires users"}},
		{"tab indentation", "mqtt:\n\tlisten: x\n", 2, "", []string{"tandem.yaml:2: found character that cannot start any token", "tabs"}},
		{"syntax error", "node:\n  name: gw\n   data_dir: x\n", 3, "", []string{"tandem.yaml:3: mapping values are not allowed"}},
		{"two documents", "node:\n  name: a\n---\nnode:\n  name: b\n", 3, "", []string{"second YAML document"}},
		{"top level list", "- node\n", 1, "", []string{"top level must be a mapping", "a list"}},
		{"merge key in section", "log:\n  <<: {level: info}\n", 2, "log", []string{"merge keys"}},
		{"complex key", "log:\n  ? [a]\n  : b\n", 2, "log", []string{"a key must be a plain name"}},
		{"uplink without broker", "uplinks:\n  - name: c\n    topics: [{match: a/#}]\n", 2, "uplinks[0].broker", []string{"want tcp://host:port"}},
		{"uplink bad filter", "uplinks:\n  - name: c\n    broker: tcp://h:1883\n    topics:\n      - match: a/#/b\n", 5, "uplinks[0].topics[0].match", []string{"'#'"}},
		{"uplink bad on_full", "uplinks:\n  - name: c\n    broker: tcp://h:1883\n    topics: [{match: a}]\n    on_full: wait\n", 5, "uplinks[0].on_full", []string{`"wait" is not refuse or drop_oldest`}},
		{"uplink bad size", "uplinks:\n  - name: c\n    max_backlog: lots\n", 3, "uplinks[0].max_backlog", []string{`"lots" is not a size`}},
		{"uplink names repeat", "uplinks:\n  - name: c\n    broker: tcp://h:1883\n    topics: [{match: a}]\n  - name: c\n    broker: tcp://h:1883\n    topics: [{match: b}]\n", 5, "uplinks[1].name", []string{"unique"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.in), "tandem.yaml")
			if err == nil {
				t.Fatalf("no error; config %+v", c)
			}
			if c != nil {
				t.Errorf("config %+v returned with an error", c)
			}
			wantConfigError(t, err, "tandem.yaml", tt.line, tt.key, tt.contains...)
		})
	}
}

func TestLoadConfigBadFiles(t *testing.T) {
	tests := []struct {
		file     string
		line     int
		key      string
		contains string
	}{
		{"bad-unknown-key.yaml", 4, "mqtt.listn", `:4: unknown key "mqtt.listn"`},
		{"bad-tabs.yaml", 3, "", "tabs"},
		{"bad-duplicate-topic.yaml", 6, "topics[2].match", `"alarms/#" repeats topics[0] (line 2)`},
		{"bad-anonymous.yaml", 3, "mqtt.listen", "requires users"},
		{"bad-two-documents.yaml", 3, "", "second YAML document"},
		{"bad-duration.yaml", 4, "cluster.sync_timeout", `:4: cluster.sync_timeout: "5" is not a duration (use a unit, e.g. 5s)`},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			path := configTestdata(tt.file)
			_, err := Load(path)
			wantConfigError(t, err, path, tt.line, tt.key, path+":", tt.contains)
		})
	}
}

func TestConfigValidateInCode(t *testing.T) {
	c := DefaultConfig()
	c.MQTT.Listen = "[::]:1883"
	err := c.Validate()
	wantConfigError(t, err, "", 0, "mqtt.listen", "requires users")
	if got := err.Error(); !strings.HasPrefix(got, "mqtt.listen: ") {
		t.Errorf("error without a file = %q, want it to start with the key", got)
	}

	for _, ok := range []func(*Config){
		func(c *Config) { c.MQTT.AllowAnonymous = true },
		func(c *Config) { c.MQTT.UsersFile = "/etc/tandem/users" },
		func(c *Config) { c.MQTT.Listen = "[::1]:1883" },
		func(c *Config) { c.MQTT.Listen = "localhost:1883" },
		func(c *Config) { c.MQTT.Listen = "127.0.0.2:0" },
	} {
		c := DefaultConfig()
		c.MQTT.Listen = "192.0.2.1:1883"
		ok(c)
		if err := c.Validate(); err != nil {
			t.Errorf("%+v: %v", c.MQTT, err)
		}
	}

	c = DefaultConfig()
	c.Cluster.SyncTimeout = Duration(-time.Second)
	wantConfigError(t, c.Validate(), "", 0, "cluster.sync_timeout", "negative")

	c = DefaultConfig()
	c.Cluster.MinSyncReplicas = -1
	wantConfigError(t, c.Validate(), "", 0, "cluster.min_sync_replicas")
}

func TestConfigAnonymousAllowed(t *testing.T) {
	tests := []struct {
		m    MQTTConfig
		want bool
	}{
		{DefaultConfig().MQTT, true}, // loopback, no users: the standalone default
		{MQTTConfig{UsersFile: "u"}, false},
		{MQTTConfig{UsersFile: "u", AllowAnonymous: true}, true},
		{MQTTConfig{AllowAnonymous: true}, true},
	}
	for _, tt := range tests {
		if got := tt.m.AnonymousAllowed(); got != tt.want {
			t.Errorf("%+v.AnonymousAllowed() = %v, want %v", tt.m, got, tt.want)
		}
	}
}

func TestParseConfigAliases(t *testing.T) {
	in := "x: &t 2s\n"
	if _, err := Parse([]byte(in), "a.yaml"); err == nil {
		t.Fatal("unknown top-level key x accepted")
	}
	in = "cluster:\n  sync_timeout: &t 2s\n  failover_after: *t\n" +
		"topics:\n  - &r {match: a/#, ack: sync}\n" +
		"storage:\n  max_age: &bad 5\nlog:\n  level: info\n"
	_, err := Parse([]byte(in), "a.yaml")
	wantConfigError(t, err, "a.yaml", 7, "storage.max_age", "use a unit")

	in = "cluster:\n  sync_timeout: &t 2s\n  failover_after: *t\n" +
		"topics:\n  - &r {match: a/#, ack: sync}\n  - *r\n"
	_, err = Parse([]byte(in), "a.yaml")
	wantConfigError(t, err, "a.yaml", 6, "topics[1].match", "repeats topics[0] (line 5)")

	in = "cluster:\n  sync_timeout: &t 2s\n  failover_after: *t\n"
	c, err := Parse([]byte(in), "a.yaml")
	if err != nil || c.Cluster.FailoverAfter != Duration(2*time.Second) {
		t.Fatalf("alias: %v, %v", c, err)
	}
}

func TestConfigErrorFormat(t *testing.T) {
	tests := []struct {
		err  ConfigError
		want string
	}{
		{ConfigError{File: "t.yaml", Line: 12, Key: "cluster.sync_timeout", Msg: "bad"}, "t.yaml:12: cluster.sync_timeout: bad"},
		{ConfigError{File: "t.yaml", Line: 4, Key: "mqtt.listn", Msg: `unknown key "mqtt.listn"`}, `t.yaml:4: unknown key "mqtt.listn"`},
		{ConfigError{File: "t.yaml", Msg: "cannot read"}, "t.yaml: cannot read"},
		{ConfigError{Key: "log.level", Msg: "bad"}, "log.level: bad"},
		{ConfigError{Line: 3, Msg: "bad"}, "line 3: bad"},
	}
	for _, tt := range tests {
		if got := tt.err.Error(); got != tt.want {
			t.Errorf("Error() = %q, want %q", got, tt.want)
		}
	}
}

func TestConfigDuration(t *testing.T) {
	good := map[string]time.Duration{
		"0": 0, "0s": 0, "500ms": 500 * time.Millisecond, "5s": 5 * time.Second,
		"1m30s": 90 * time.Second, " 10m ": 10 * time.Minute, "1.5h": 90 * time.Minute,
	}
	for in, want := range good {
		got, err := parseConfigDuration(in)
		if err != nil || got != want {
			t.Errorf("parseConfigDuration(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	bad := map[string]string{
		"5": "use a unit, e.g. 5s", "1.5": "use a unit", "-5s": "negative",
		"": "not a duration", "5 parsecs": "not a duration", "1e3": "not a duration",
	}
	for in, want := range bad {
		if _, err := parseConfigDuration(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseConfigDuration(%q) error = %v, want %q", in, err, want)
		}
	}
	if s := Duration(1500 * time.Millisecond).String(); s != "1.5s" {
		t.Errorf("String() = %q", s)
	}
}

func TestConfigByteSize(t *testing.T) {
	good := map[string]ByteSize{
		"0": 0, "1024": 1024, "100B": 100, "512MiB": 512 << 20, "1GB": 1e9, "100KiB": 100 << 10,
		"10 MB": 10e6, "1.5GiB": 3 << 29, "2tib": 2 << 40, "1TB": 1e12, "0.5KB": 500,
		"18446744073709551615": 1<<64 - 1,
	}
	for in, want := range good {
		got, err := parseByteSize(in)
		if err != nil || got != want {
			t.Errorf("parseByteSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	bad := map[string]string{
		"-1": "negative", "-1GB": "negative", "": "not a size", "lots": "not a size",
		"1.2.3MB": "not a size", "MB": "not a size", "1 PiB": "unknown unit", "10 XB": "unknown unit",
		"0.0001KB": "whole number", "18446744073709551616": "too large", "20000000TB": "too large",
		"0x10": "not a size", "1_000": "not a size", "1e9": "not a size",
	}
	for in, want := range bad {
		if _, err := parseByteSize(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseByteSize(%q) error = %v, want %q", in, err, want)
		}
	}
	for _, b := range []ByteSize{0, 1, 1000, 1024, 1536, 512 << 20, 1e9, 3 << 29, 1<<64 - 1, 1e12, 1 << 40} {
		s := b.String()
		back, err := parseByteSize(s)
		if err != nil || back != b {
			t.Errorf("%d.String() = %q parses back as %d, %v", uint64(b), s, back, err)
		}
	}
	if s := ByteSize(512 << 20).String(); s != "512MiB" {
		t.Errorf("String() = %q, want 512MiB", s)
	}
}

func TestConfigTopicFilter(t *testing.T) {
	for _, f := range []string{"#", "+", "a", "a/b", "a/+/c", "a/#", "+/+", "/", "a//b", "$SYS/#", "+/#", "é/ü"} {
		if err := checkTopicFilter(f); err != nil {
			t.Errorf("checkTopicFilter(%q) = %v", f, err)
		}
	}
	for _, f := range []string{"", "a#", "#/a", "a/#/b", "a+", "a/+b", "++", "a/\x00", "\xff", "##", strings.Repeat("a", 65536)} {
		if err := checkTopicFilter(f); err == nil {
			t.Errorf("checkTopicFilter(%q) = nil, want an error", f)
		}
	}
}

func FuzzParseConfig(f *testing.F) {
	files, _ := filepath.Glob(configTestdata("*.yaml"))
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	for _, s := range []string{
		"", "mqtt:\n  listen: ::1\n", "topics:\n  - {match: a/+/#, ack: sync}\n",
		"a: &x [*x]\n", "cluster: &c {heartbeat: 1s}\nlog: *c\n", "storage: {max_bytes: 1.5GiB, max_age: 1h}\n",
		"peer:\n  advertise: [a:1, b:2]\n", "node: {name: \"\\x01\"}\n", "? [a]\n: b\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse(data, "fuzz.yaml")
		if err != nil {
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("error %v is a %T, not a *ConfigError", err, err)
			}
			if ce.Line < 0 || ce.File != "fuzz.yaml" || c != nil {
				t.Fatalf("bad error %#v (config %v)", ce, c)
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("parsed config does not validate again: %v", err)
		}
		// What parses must print and parse back to the same thing.
		out, err := yaml.Marshal(c)
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		back, err := Parse(out, "marshalled")
		if err != nil {
			t.Fatalf("marshalled config does not parse: %v\n%s", err, out)
		}
		if len(c.Topics) == 0 {
			c.Topics = back.Topics
		}
		if len(c.Peer.Advertise) == 0 {
			c.Peer.Advertise = back.Peer.Advertise
		}
		if len(c.HTTP.AllowedHosts) == 0 {
			c.HTTP.AllowedHosts = back.HTTP.AllowedHosts
		}
		if len(c.Uplinks) == 0 {
			c.Uplinks = back.Uplinks
		}
		if !reflect.DeepEqual(back, c) {
			t.Fatalf("round trip changed the config:\n%+v\n%+v\n%s", c, back, out)
		}
	})
}
