package daemon

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/big"
	"net"
	"net/netip"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"gopkg.in/yaml.v3"

	"github.com/tandem-edge/tandem/mqtt"
)

// Config is the whole of tandem.yaml. Start from DefaultConfig (LoadConfig
// does) and call Validate after changing fields, e.g. from command-line flags.
// Validate fills every zero field that has a default, so a partial file, an
// explicit zero ("sync_timeout: 0s") and a Config built in code all mean the
// documented defaults.
type Config struct {
	// Node names this gateway and says where its state lives.
	Node NodeConfig `yaml:"node"`
	// MQTT configures the broker devices talk to.
	MQTT MQTTConfig `yaml:"mqtt"`
	// Peer configures the listener for the other gateways of the cluster.
	Peer PeerConfig `yaml:"peer"`
	// HTTP configures the status, metrics and control API used by the CLI.
	HTTP HTTPConfig `yaml:"http"`
	// Log configures the daemon's own log output.
	Log LogConfig `yaml:"log"`
	// Cluster sets replication, election and failover timing.
	Cluster ClusterConfig `yaml:"cluster"`
	// Storage sets the log's flush policy and retention.
	Storage StorageConfig `yaml:"storage"`
	// Topics is the ordered list of ack rules: the first rule whose Match
	// filter matches a publish's topic decides its ack mode, and a topic no
	// rule matches is async. Order matters, so this is a list, not a map.
	Topics []TopicRule `yaml:"topics"`
	// Discovery configures mDNS advertising and browsing on the LAN.
	Discovery DiscoveryConfig `yaml:"discovery"`

	// file is the path LoadConfig read, which a reload (SIGHUP) reads
	// again for the topic rules and the users and ACL files; "" for a
	// Config that did not come from a file.
	file string
}

// NodeConfig identifies the gateway.
type NodeConfig struct {
	// Name is the human name shown by status and `tandem peers`, advertised
	// over mDNS and accepted by `tandem cluster remove`. Default: the host
	// name (or "tandem" when it cannot be read), so gateways on one LAN tell
	// themselves apart without configuration.
	Name string `yaml:"name"`
	// DataDir holds the log, the node key and metadata. Default
	// "./tandem-data"; the packaged config sets /var/lib/tandem.
	DataDir string `yaml:"data_dir"`
}

// MQTTConfig configures the embedded broker.
type MQTTConfig struct {
	// Listen is the plain-TCP MQTT listener, host:port. Default
	// "127.0.0.1:1883": loopback, so an unconfigured gateway is not an open
	// broker on the LAN.
	Listen string `yaml:"listen"`
	// TLS is an optional MQTT-over-TLS listener: on when TLS.CertFile is
	// set (or TLS.Listen, which then needs it).
	TLS TLSConfig `yaml:"tls"`
	// AllowAnonymous accepts clients without credentials on a listener
	// reachable from the network. Without it (the default) such a listener
	// requires UsersFile. A loopback listener with no UsersFile accepts
	// anonymous clients either way: that is what makes the zero-config
	// standalone gateway usable.
	AllowAnonymous bool `yaml:"allow_anonymous"`
	// UsersFile holds one "user:bcrypt-hash" line per user, as printed by
	// `tandem passwd`. With it, a client that gives a user name must give
	// its password. Reloaded on SIGHUP.
	UsersFile string `yaml:"users_file"`
	// ACLFile holds the topic ACLs in Mosquitto's acl_file syntax; with it,
	// whatever it does not grant is refused. Reloaded on SIGHUP.
	ACLFile string `yaml:"acl_file"`
	// MaxInflight is the receive maximum granted to each client: how many
	// QoS 1 and 2 publishes it may have unacknowledged. Acks wait for an
	// fsync (and a slave, on sync topics), so clients need a deep pipeline
	// to reach full throughput. 1 to 65535; 0 means the default, 1024 (as
	// mochi-mqtt).
	MaxInflight int `yaml:"max_inflight"`
	// MaxPacketSize bounds one MQTT packet; a client that sends a bigger
	// one is disconnected (MQTT 5 clients learn the size from the CONNACK).
	// Default 1MiB; at most 256MiB, MQTT's own limit.
	MaxPacketSize ByteSize `yaml:"max_packet_size"`
	// MaxClients caps the connected clients; one more is refused with
	// CONNACK server busy (MQTT 3.1.1: server unavailable). Default 1000.
	MaxClients int `yaml:"max_clients"`
	// MaxTopicLength bounds a topic name or filter, in bytes. Default
	// 1024. A PUBLISH over it disconnects its client (MQTT 5: DISCONNECT
	// 0x90); a subscription over it is refused (SUBACK 0x8F, 3.1.1: 0x80).
	MaxTopicLength int `yaml:"max_topic_length"`
	// MaxTopicLevels bounds the levels of a topic name or filter, as
	// MaxTopicLength. Default 32.
	MaxTopicLevels int `yaml:"max_topic_levels"`
	// ConnectRate is the connections per second one source address (IPv4
	// address, IPv6 /64) may open on average; ConnectBurst how many it may
	// open at once. Over it a connection is closed before it is read.
	// Defaults 20 and 100; set them high to lift the limit.
	ConnectRate float64 `yaml:"connect_rate"`
	// ConnectBurst: see ConnectRate.
	ConnectBurst int `yaml:"connect_burst"`
	// KeepAliveMin and KeepAliveMax bound the keep-alive clients ask for,
	// in whole seconds; 0 means no bound. An MQTT 5 client outside them is
	// told the bound in its CONNACK; an MQTT 3.1.1 client cannot be, and is
	// refused (CONNACK 0x02, as Mosquitto's max_keepalive). A keep-alive of
	// 0 is above any maximum.
	KeepAliveMin Duration `yaml:"keepalive_min"`
	// KeepAliveMax: see KeepAliveMin.
	KeepAliveMax Duration `yaml:"keepalive_max"`
	// MaxSubscriptions caps the subscriptions of one client; a filter over
	// it gets SUBACK 0x97 quota exceeded (3.1.1: 0x80). Default 1000.
	MaxSubscriptions int `yaml:"max_subscriptions"`
	// TopicAliasMaximum is how many topic aliases an MQTT 5 client may set
	// (told in the CONNACK); an alias over it ends the connection (0x94).
	// Default 100, at most 65535.
	TopicAliasMaximum int `yaml:"topic_alias_maximum"`
	// MaxQueued is how many messages a connected client's session holds
	// in memory ready to send. Default 1000.
	MaxQueued int `yaml:"max_queued"`
	// QueueFull says what happens to a client that falls further behind
	// than max_queued: read_log (the default) hands it the rest from the
	// log as it catches up, slowing nobody else; disconnect ends its
	// connection (MQTT 5: DISCONNECT 0x97), and a persistent session
	// resumes from its cursor when it comes back.
	QueueFull string `yaml:"queue_full"`
	// WebSocket is an optional MQTT-over-WebSocket listener for browser
	// dashboards, with the same users, ACLs and limits: on when
	// WebSocket.Listen is set.
	WebSocket WebSocketConfig `yaml:"websocket"`
}

// WebSocketConfig holds the settings of the MQTT-over-WebSocket listener
// (subprotocol "mqtt", any path).
type WebSocketConfig struct {
	// Listen is the listener's host:port; "" (the default) means none.
	Listen string `yaml:"listen"`
	// TLS serves wss:// with mqtt.tls's certificate and key.
	TLS bool `yaml:"tls"`
	// Origins are the browser origins (host patterns such as
	// "dash.example.com" or "*.example.com") whose pages may connect,
	// besides the listener's own host: a page of any other site is
	// refused, so a web page cannot reach a gateway through its visitor's
	// browser.
	Origins []string `yaml:"origins,omitempty"`
}

// AnonymousAllowed reports whether the broker should accept clients without
// credentials: when AllowAnonymous says so, and also when there is no
// UsersFile at all, which Validate permits only on loopback listeners (the
// zero-config standalone gateway). AllowAnonymous alone is not the answer.
func (m MQTTConfig) AnonymousAllowed() bool {
	return m.AllowAnonymous || m.UsersFile == ""
}

// TLSConfig holds the settings of the MQTT-over-TLS listener.
type TLSConfig struct {
	// Listen is the TLS listener's host:port. Default ":8883" once
	// CertFile is set; the listener is off without CertFile.
	Listen string `yaml:"listen"`
	// CertFile is the PEM server certificate (chain). Its contents are
	// read again on SIGHUP, so a renewed certificate needs no restart.
	CertFile string `yaml:"cert_file"`
	// KeyFile is the PEM private key of CertFile.
	KeyFile string `yaml:"key_file"`
	// CAFile is a PEM bundle of the CAs that sign client certificates; a
	// client certificate that is presented must chain to one of them.
	CAFile string `yaml:"ca_file"`
	// RequireClientCert refuses, in the TLS handshake, clients without a
	// valid certificate from CAFile (expired and untrusted ones included).
	// Such a listener needs no users_file: the certificate is the
	// credential.
	RequireClientCert bool `yaml:"require_client_cert"`
	// UseIdentityAsUsername makes a client certificate's common name the
	// client's user name for the ACLs, with no password asked, as
	// Mosquitto's use_identity_as_username. Needs RequireClientCert.
	UseIdentityAsUsername bool `yaml:"use_identity_as_username"`
	// MinVersion is the oldest TLS version accepted: 1.2 (default) or 1.3.
	MinVersion string `yaml:"min_version"`
}

// Enabled reports whether the TLS listener is configured.
func (t TLSConfig) Enabled() bool { return t.Listen != "" || t.CertFile != "" }

// PeerConfig configures the gateway-to-gateway (raft) listener.
type PeerConfig struct {
	// Listen is the peer listener, host:port. Default "127.0.0.1:7883":
	// loopback, as every embedded default is, so that a gateway tried out
	// on a laptop opens nothing to the LAN; sibling gateways need it on
	// the LAN (":7883", as the packaged config sets). Only pinned member
	// certificates and join tokens are accepted there.
	Listen string `yaml:"listen"`
	// Advertise lists the host:port addresses other gateways should dial,
	// for when the listener's own address is not reachable as is (NAT,
	// several interfaces). Empty means the addresses found at run time.
	Advertise []string `yaml:"advertise"`
}

// HTTPConfig configures the HTTP API (status, metrics, cluster commands).
type HTTPConfig struct {
	// Listen is the HTTP listener, host:port. Default "127.0.0.1:7880": the
	// API can change the cluster, so it stays on loopback unless configured.
	Listen string `yaml:"listen"`
	// TokenFile holds the bearer token the API's mutating endpoints
	// require (its first line). "" means the token the daemon writes into
	// the data dir at first start (http-token, mode 0600), which the CLI
	// finds through --config or --data.
	TokenFile string `yaml:"token_file"`
	// AllowedHosts are host names, besides loopback, this machine's name
	// and the address a request arrives at, that requests may name in
	// their Host header: the names a remote Prometheus or browser uses.
	// Any other name is refused, so that a DNS-rebinding web page cannot
	// reach the API under its own domain.
	AllowedHosts []string `yaml:"allowed_hosts"`
}

// LogConfig configures the daemon's log.
type LogConfig struct {
	// Level is the least severe level logged: debug, info, warn or error.
	// Default info.
	Level string `yaml:"level"`
	// Format is text (default, for the journal and a terminal) or json (for
	// log shippers).
	Format string `yaml:"format"`
}

// ClusterConfig sets replication and failover behaviour.
type ClusterConfig struct {
	// Failover is manual (default: a 2-gateway slave waits for `tandem
	// promote`) or auto (it promotes itself after FailoverAfter of silence,
	// at the risk of a split brain that the rejoin rule later repairs).
	// 3-gateway clusters always elect automatically.
	Failover string `yaml:"failover"`
	// FailoverAfter is how long nothing at all (no append, heartbeat or
	// request) must arrive from the master before an auto failover probes
	// it; only a master that does not answer the probe is replaced
	// (promote.go: checkFailover). Default 10s.
	FailoverAfter Duration `yaml:"failover_after"`
	// SyncTimeout is how long a sync publish waits for its replicas before
	// it is refused (MQTT 5) or its client disconnected (MQTT 3.1.1).
	// Default 5s.
	SyncTimeout Duration `yaml:"sync_timeout"`
	// MinSyncReplicas is how many slaves must hold a sync record on disk
	// before it is acked: 1 or 2, as a cluster has at most 3 gateways.
	// 0 means the default, 1.
	MinSyncReplicas int `yaml:"min_sync_replicas"`
	// Heartbeat is the master's heartbeat interval, raft's tick. Default
	// 100ms.
	Heartbeat Duration `yaml:"heartbeat"`
	// ElectionTimeout is how long a voter waits without hearing the master
	// before it starts an election. It must exceed twice Heartbeat, or one
	// late heartbeat would start an election. Default 1s.
	ElectionTimeout Duration `yaml:"election_timeout"`
}

// DefaultMaxBytes is storage.max_bytes when the config does not set it;
// the packaged config sets 1GiB.
const DefaultMaxBytes ByteSize = 256 << 20

// MinMaxBytes is the least storage.max_bytes accepted.
const MinMaxBytes ByteSize = 8 << 20

// StorageConfig sets the log's durability and retention.
type StorageConfig struct {
	// Flush is always (default: fsync each batch before acking it) or
	// interval (RocketMQ's ASYNC_FLUSH: ack once the batch is written, fsync
	// every FlushInterval; a process crash loses nothing, a power cut up to
	// one interval of acked records).
	Flush string `yaml:"flush"`
	// FlushInterval is the fsync period when Flush is interval; it is
	// ignored otherwise. Default 200ms.
	FlushInterval Duration `yaml:"flush_interval"`
	// MaxBytes is the data dir's budget (WAL and data file): the log drops
	// its oldest records, whole runs at a time, to stay within it plus
	// storage.RetentionSlack (2MiB), never what a member still lacks.
	// Default 256MiB; at least 8MiB (the WAL and bbolt's reserve take 4).
	MaxBytes ByteSize `yaml:"max_bytes"`
	// MaxAge drops records older than this, whole runs at a time (a run is
	// a few KiB of records). 0 means records are kept whatever their age.
	MaxAge Duration `yaml:"max_age"`
}

// TopicRule gives the ack mode of the topics one MQTT filter matches.
type TopicRule struct {
	// Match is an MQTT topic filter; + and # wildcards allowed.
	Match string `yaml:"match"`
	// Ack is sync (acked once min_sync_replicas slaves have the record on
	// disk) or async (acked once the master has it on disk). Required.
	Ack string `yaml:"ack"`
}

// DiscoveryConfig configures mDNS.
type DiscoveryConfig struct {
	// MDNS turns on advertising and browsing. Default false: a daemon never
	// multicasts unless it serves a LAN; the packaged config turns it on.
	MDNS bool `yaml:"mdns"`
	// Interface restricts mDNS to one network interface; "" means all.
	Interface string `yaml:"interface"`
}

// DefaultConfig returns the configuration of `tandem run` with no config file
// and no flags: a standalone gateway on loopback.
func DefaultConfig() *Config {
	c := &Config{}
	c.setDefaults()
	return c
}

// setDefaults is shared by DefaultConfig and Validate so that the two can
// never disagree about a default.
func (c *Config) setDefaults() {
	setDefaultIfZero(&c.Node.Name, defaultNodeName())
	setDefaultIfZero(&c.Node.DataDir, "./tandem-data")
	setDefaultIfZero(&c.MQTT.Listen, "127.0.0.1:1883")
	setDefaultIfZero(&c.MQTT.MaxInflight, 1024)
	setDefaultIfZero(&c.MQTT.MaxPacketSize, 1<<20)
	setDefaultIfZero(&c.MQTT.MaxClients, 1000)
	setDefaultIfZero(&c.MQTT.MaxTopicLength, 1024)
	setDefaultIfZero(&c.MQTT.MaxTopicLevels, 32)
	setDefaultIfZero(&c.MQTT.ConnectRate, 20)
	setDefaultIfZero(&c.MQTT.ConnectBurst, 100)
	if c.MQTT.TLS.CertFile != "" {
		// A certificate is the sign that TLS is wanted; 8883 is MQTT's
		// registered TLS port.
		setDefaultIfZero(&c.MQTT.TLS.Listen, ":8883")
	}
	if c.MQTT.TLS.Enabled() {
		setDefaultIfZero(&c.MQTT.TLS.MinVersion, "1.2")
	}
	setDefaultIfZero(&c.Peer.Listen, "127.0.0.1:7883")
	setDefaultIfZero(&c.HTTP.Listen, "127.0.0.1:7880")
	setDefaultIfZero(&c.Log.Level, "info")
	setDefaultIfZero(&c.Log.Format, "text")
	setDefaultIfZero(&c.Cluster.Failover, "manual")
	setDefaultIfZero(&c.Cluster.FailoverAfter, Duration(10*time.Second))
	setDefaultIfZero(&c.Cluster.SyncTimeout, Duration(5*time.Second))
	setDefaultIfZero(&c.Cluster.MinSyncReplicas, 1)
	setDefaultIfZero(&c.Cluster.Heartbeat, Duration(100*time.Millisecond))
	setDefaultIfZero(&c.Cluster.ElectionTimeout, Duration(time.Second))
	setDefaultIfZero(&c.Storage.Flush, "always")
	setDefaultIfZero(&c.Storage.FlushInterval, Duration(200*time.Millisecond))
	setDefaultIfZero(&c.Storage.MaxBytes, DefaultMaxBytes)
}

func setDefaultIfZero[T comparable](p *T, def T) {
	var zero T
	if *p == zero {
		*p = def
	}
}

func defaultNodeName() string {
	if h, err := os.Hostname(); err == nil && h != "" {
		return h
	}
	return "tandem"
}

// LoadConfig reads the YAML file at path on top of DefaultConfig and
// validates the result. Every error is a *ConfigError naming path, and the
// key and line when there are some; a read error is wrapped in it, so
// errors.Is(err, fs.ErrNotExist) still works.
func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		cause := err
		var pe *fs.PathError
		if errors.As(err, &pe) {
			cause = pe.Err // the path is in File already
		}
		return nil, &ConfigError{File: path, Msg: "cannot read: " + cause.Error(), Err: err}
	}
	c, err := ParseConfig(data, path)
	if err != nil {
		return nil, err
	}
	c.file = path
	return c, nil
}

// ParseConfig is LoadConfig on data already in memory; name is used as the
// file name in errors. An empty document gives the defaults, and so does a
// key with no value. Unknown keys, a second YAML document and merge keys
// ("<<") are errors.
func ParseConfig(data []byte, name string) (*Config, error) {
	w := &configWalker{file: name, lines: map[string]int{}}
	root, err := w.parse(data)
	if err != nil {
		return nil, err
	}
	cfg := DefaultConfig()
	if root != nil {
		// Walking first gives errors with key paths; yaml.v3's own say
		// "field listn not found in type daemon.MQTTConfig".
		if err := w.walk(root, reflect.TypeFor[Config](), "", 0); err != nil {
			return nil, err
		}
		dec := yaml.NewDecoder(bytes.NewReader(data))
		dec.KnownFields(true)
		if err := dec.Decode(cfg); err != nil {
			// Unreachable while the walk checks what the decoder checks;
			// kept so a gap between them still yields a ConfigError.
			return nil, w.decodeError(err)
		}
	}
	if err := cfg.validate(w); err != nil {
		return nil, err
	}
	return cfg, nil
}

// ConfigError is the error of LoadConfig, ParseConfig and Validate. The CLI
// tells a bad config (exit 2) from a runtime failure with errors.As.
type ConfigError struct {
	// File is the config file's name as given; "" when the Config did not
	// come from a file (a Config built in code or changed by flags).
	File string
	// Line is the 1-based line in File; 0 when unknown.
	Line int
	// Key is the key path, with 0-based list indexes: "cluster.sync_timeout",
	// "topics[2].ack". "" for errors about the whole file.
	Key string
	// Msg says what is wrong and, where it can, what to write instead.
	Msg string
	// Err is the underlying error, if any (a read error).
	Err error
}

// Error formats the error as "file:line: key: message", leaving out the
// parts that are unknown, and the key when Msg already quotes it (unknown
// and duplicate keys), as in `tandem.yaml:4: unknown key "mqtt.listn"`.
func (e *ConfigError) Error() string {
	var b strings.Builder
	switch {
	case e.File != "" && e.Line > 0:
		fmt.Fprintf(&b, "%s:%d: ", e.File, e.Line)
	case e.File != "":
		b.WriteString(e.File + ": ")
	case e.Line > 0:
		fmt.Fprintf(&b, "line %d: ", e.Line)
	}
	if e.Key != "" && !strings.Contains(e.Msg, strconv.Quote(e.Key)) {
		b.WriteString(e.Key + ": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Unwrap returns Err.
func (e *ConfigError) Unwrap() error { return e.Err }

// Duration is a time.Duration written in YAML as a Go duration string
// ("500ms", "5s", "10m"). A bare number other than 0 is refused rather than
// guessed: "5" could mean seconds, or nanoseconds as in time.Duration.
type Duration time.Duration

// Duration returns d as a time.Duration.
func (d Duration) Duration() time.Duration { return time.Duration(d) }

// String formats d as time.Duration does.
func (d Duration) String() string { return time.Duration(d).String() }

// MarshalYAML writes d in the form UnmarshalYAML reads.
func (d Duration) MarshalYAML() (any, error) { return d.String(), nil }

// UnmarshalYAML parses a non-negative Go duration. Its errors are
// *ConfigError with the node's line.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return &ConfigError{Line: n.Line, Msg: "expected a duration (e.g. 5s), got " + describeYAMLNode(n)}
	}
	v, err := parseConfigDuration(n.Value)
	if err != nil {
		return &ConfigError{Line: n.Line, Msg: err.Error()}
	}
	*d = Duration(v)
	return nil
}

func parseConfigDuration(s string) (time.Duration, error) {
	t := strings.TrimSpace(s)
	if t == "0" {
		return 0, nil
	}
	if isBareNumber(t) {
		return 0, fmt.Errorf("%s is not a duration (use a unit, e.g. %ss)", quoteConfigValue(s), t)
	}
	v, err := time.ParseDuration(t)
	if err != nil {
		return 0, fmt.Errorf("%s is not a duration (e.g. 500ms, 5s, 10m)", quoteConfigValue(s))
	}
	if v < 0 {
		return 0, fmt.Errorf("%s is negative", quoteConfigValue(s))
	}
	return v, nil
}

func isBareNumber(s string) bool {
	s = strings.TrimLeft(s, "+-")
	digits := false
	for _, r := range s {
		switch {
		case r >= '0' && r <= '9':
			digits = true
		case r != '.':
			return false
		}
	}
	return digits
}

// ByteSize is a size in bytes, written with a unit: "512MiB", "1GB",
// "10 MB", "1.5GiB", or a plain number of bytes ("1024"). KiB, MiB, GiB and
// TiB are powers of 1024, KB, MB, GB and TB powers of 1000 (units are not
// case-sensitive), so both habits mean what they say.
type ByteSize uint64

type byteUnit struct {
	name string
	mult uint64
}

// byteUnits runs from the largest unit down, the order String needs.
var byteUnits = []byteUnit{
	{"TiB", 1 << 40}, {"TB", 1e12}, {"GiB", 1 << 30}, {"GB", 1e9},
	{"MiB", 1 << 20}, {"MB", 1e6}, {"KiB", 1 << 10}, {"KB", 1e3}, {"B", 1},
}

// String formats b in the largest unit that divides it exactly, e.g.
// "512MiB", "1GB", "1536B", so that it parses back to the same value.
func (b ByteSize) String() string {
	for _, u := range byteUnits {
		if b != 0 && uint64(b)%u.mult == 0 {
			return strconv.FormatUint(uint64(b)/u.mult, 10) + u.name
		}
	}
	return strconv.FormatUint(uint64(b), 10) + "B"
}

// MarshalYAML writes b in the form UnmarshalYAML reads.
func (b ByteSize) MarshalYAML() (any, error) { return b.String(), nil }

// UnmarshalYAML parses a size. Its errors are *ConfigError with the node's
// line.
func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return &ConfigError{Line: n.Line, Msg: "expected a size (e.g. 512MiB), got " + describeYAMLNode(n)}
	}
	v, err := parseByteSize(n.Value)
	if err != nil {
		return &ConfigError{Line: n.Line, Msg: err.Error()}
	}
	*b = v
	return nil
}

var byteSizeRE = regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)$`)

func parseByteSize(s string) (ByteSize, error) {
	t := strings.TrimSpace(s)
	if strings.HasPrefix(t, "-") {
		return 0, fmt.Errorf("%s is negative", quoteConfigValue(s))
	}
	m := byteSizeRE.FindStringSubmatch(t)
	if m == nil {
		return 0, fmt.Errorf("%s is not a size (e.g. 512MiB, 1GB, 1024)", quoteConfigValue(s))
	}
	mult := uint64(1)
	if m[2] != "" {
		i := slices.IndexFunc(byteUnits, func(u byteUnit) bool { return strings.EqualFold(u.name, m[2]) })
		if i < 0 {
			return 0, fmt.Errorf("%s has an unknown unit %s (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)", quoteConfigValue(s), quoteConfigValue(m[2]))
		}
		mult = byteUnits[i].mult
	}
	// Exact arithmetic: "1.5GiB" is a whole number of bytes, and float64
	// would round large sizes.
	whole, frac, _ := strings.Cut(m[1], ".")
	num, _ := new(big.Int).SetString(whole+frac, 10)
	num.Mul(num, new(big.Int).SetUint64(mult))
	den := new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(len(frac))), nil)
	q, r := num.QuoRem(num, den, new(big.Int))
	if r.Sign() != 0 {
		return 0, fmt.Errorf("%s is not a whole number of bytes", quoteConfigValue(s))
	}
	if !q.IsUint64() {
		return 0, fmt.Errorf("%s is too large (at most 16 EiB)", quoteConfigValue(s))
	}
	return ByteSize(q.Uint64()), nil
}

// configWalker checks a parsed YAML tree against Config's shape by
// reflection on the yaml tags, so that errors carry the key path and line,
// and records the line of every key for the errors of Validate.
type configWalker struct {
	file  string
	lines map[string]int // key path -> line of the key (list item: of the item)
}

var yamlErrRE = regexp.MustCompile(`(?s)^(?:yaml: )?line (\d+): (.*)$`)

// parse returns the document's top-level mapping, or nil for an empty
// document.
func (w *configWalker) parse(data []byte) (*yaml.Node, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) { // empty, or comments only
			return nil, nil
		}
		return nil, w.syntaxError(err, data)
	}
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case err == nil:
		return nil, w.errorf(next.Line, "", "a second YAML document starts here; a config file holds one document")
	case !errors.Is(err, io.EOF):
		return nil, w.syntaxError(err, data)
	}
	if len(doc.Content) == 0 || isYAMLNull(doc.Content[0]) {
		return nil, nil
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, w.errorf(root.Line, "", "the top level must be a mapping of sections (node:, mqtt:, ...), not %s", describeYAMLNode(root))
	}
	return root, nil
}

func (w *configWalker) syntaxError(err error, data []byte) error {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	line := 0
	if m := yamlErrRE.FindStringSubmatch(err.Error()); m != nil {
		line, _ = strconv.Atoi(m[1])
		msg = m[2]
	}
	if tabIndentedLine(data, line) {
		msg += " (indent with spaces: YAML does not allow tabs)"
	}
	return w.errorf(line, "", "%s", msg)
}

// tabIndentedLine reports whether the given 1-based line is indented with a
// tab, the most common cause of yaml's cryptic "found character that cannot
// start any token".
func tabIndentedLine(data []byte, line int) bool {
	if line < 1 {
		return false
	}
	lines := bytes.SplitN(data, []byte("\n"), line+1)
	if len(lines) < line {
		return false
	}
	l := lines[line-1]
	indent := l[:len(l)-len(bytes.TrimLeft(l, " \t"))]
	return bytes.IndexByte(indent, '\t') >= 0
}

var yamlUnmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()

// walk checks n against type t at key path. It recurses only along t, so
// it stays shallow whatever the document holds (aliases included). Inside
// an alias, aliasLine is the alias's line: errors and recorded lines point
// where the value is used, which is what the key path names.
func (w *configWalker) walk(n *yaml.Node, t reflect.Type, path string, aliasLine int) error {
	if n.Kind == yaml.AliasNode && aliasLine == 0 {
		aliasLine = n.Line
	}
	line := cmp.Or(aliasLine, n.Line)
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	if isYAMLNull(n) {
		return nil // a key with no value keeps its default
	}
	if reflect.PointerTo(t).Implements(yamlUnmarshalerType) {
		return w.leaf(n, line, t, path)
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			return w.errorf(line, path, "expected a mapping of keys (%s), got %s", strings.Join(yamlFieldNames(t), ", "), describeYAMLNode(n))
		}
		return w.mapping(n, t, path, aliasLine)
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			return w.errorf(line, path, "expected a list, got %s", describeYAMLNode(n))
		}
		for i, item := range n.Content {
			key := fmt.Sprintf("%s[%d]", path, i)
			w.lines[key] = cmp.Or(aliasLine, item.Line)
			if err := w.walk(item, t.Elem(), key, aliasLine); err != nil {
				return err
			}
		}
		return nil
	}
	return w.leaf(n, line, t, path)
}

func (w *configWalker) mapping(n *yaml.Node, t reflect.Type, path string, aliasLine int) error {
	fields := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if name, _, _ := strings.Cut(f.Tag.Get("yaml"), ","); f.IsExported() && name != "" && name != "-" {
			fields[name] = f.Type
		}
	}
	firstLine := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		line := cmp.Or(aliasLine, k.Line)
		if k.Kind != yaml.ScalarNode {
			return w.errorf(line, path, "a key must be a plain name, not %s", describeYAMLNode(k))
		}
		key := k.Value
		if path != "" {
			key = path + "." + k.Value
		}
		if k.ShortTag() == "!!merge" {
			// The walk would have to mirror yaml.v3's override rules to
			// know each key's line; a config file does not need merges.
			return w.errorf(line, path, "merge keys (<<) are not supported; write the keys out")
		}
		ft, ok := fields[k.Value]
		if !ok {
			return w.errorf(line, key, "unknown key %q%s", key, unknownKeyHint(k.Value, path, yamlFieldNames(t)))
		}
		if first, dup := firstLine[k.Value]; dup {
			return w.errorf(line, key, "duplicate key %q (first at line %d)", key, first)
		}
		firstLine[k.Value] = k.Line
		w.lines[key] = line
		if err := w.walk(v, ft, key, aliasLine); err != nil {
			return err
		}
	}
	return nil
}

// leaf decodes a scalar into a scratch value of type t to find type errors
// while the key path is known.
func (w *configWalker) leaf(n *yaml.Node, line int, t reflect.Type, path string) error {
	isInt := t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64 && !reflect.PointerTo(t).Implements(yamlUnmarshalerType)
	if isInt && n.Kind == yaml.ScalarNode && n.ShortTag() != "!!int" {
		// yaml.v3 would truncate 1.5 to 1.
		return w.errorf(line, path, "%s is not a whole number", quoteConfigValue(n.Value))
	}
	err := n.Decode(reflect.New(t).Interface())
	if err == nil {
		return nil
	}
	var ce *ConfigError
	if errors.As(err, &ce) {
		// line, not ce.Line: for an alias, the place of use, where path is.
		return w.errorf(line, path, "%s", ce.Msg)
	}
	switch {
	case n.Kind != yaml.ScalarNode:
		return w.errorf(line, path, "expected %s, got %s", yamlKindWord(t), describeYAMLNode(n))
	case t.Kind() == reflect.Bool:
		return w.errorf(line, path, "%s is not true or false", quoteConfigValue(n.Value))
	case isInt:
		return w.errorf(line, path, "%s is out of range", quoteConfigValue(n.Value))
	}
	return w.errorf(line, path, "%s is not %s", quoteConfigValue(n.Value), yamlKindWord(t))
}

// decodeError turns an error of the final yaml.v3 decode into a ConfigError.
func (w *configWalker) decodeError(err error) error {
	var ce *ConfigError
	if errors.As(err, &ce) {
		return w.errorf(ce.Line, w.keyAt(ce.Line), "%s", ce.Msg)
	}
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	var te *yaml.TypeError
	if errors.As(err, &te) && len(te.Errors) > 0 {
		msg = te.Errors[0]
	}
	line := 0
	if m := yamlErrRE.FindStringSubmatch(msg); m != nil {
		line, _ = strconv.Atoi(m[1])
		msg = m[2]
	}
	return w.errorf(line, w.keyAt(line), "%s", msg)
}

// keyAt returns the deepest key path recorded at line, or "".
func (w *configWalker) keyAt(line int) string {
	best := ""
	for k, l := range w.lines {
		if l == line && line > 0 && (len(k) > len(best) || len(k) == len(best) && k < best) {
			best = k
		}
	}
	return best
}

func (w *configWalker) errorf(line int, key, format string, args ...any) *ConfigError {
	return &ConfigError{File: w.file, Line: max(line, 0), Key: key, Msg: fmt.Sprintf(format, args...)}
}

// line returns the line of key, or else of its nearest ancestor in the
// file, so that an error about a missing key points at its section.
func (w *configWalker) line(key string) int {
	if w == nil {
		return 0
	}
	for key != "" {
		if l, ok := w.lines[key]; ok {
			return l
		}
		i := strings.LastIndexAny(key, ".[")
		if i < 0 {
			break
		}
		key = key[:i]
	}
	return 0
}

func yamlFieldNames(t reflect.Type) []string {
	var keys []string
	for i := range t.NumField() {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ","); name != "" && name != "-" {
			keys = append(keys, name)
		}
	}
	return keys
}

// unknownKeyHint suggests the known key nearest to a misspelt one, or lists them.
func unknownKeyHint(key, path string, known []string) string {
	best, bestDist := "", 3 // more than 2 edits is a different word
	for _, k := range known {
		if d := keyEditDistance(strings.ToLower(key), k); d < bestDist {
			best, bestDist = k, d
		}
	}
	if best != "" {
		if path != "" {
			best = path + "." + best
		}
		return fmt.Sprintf(" (did you mean %q?)", best)
	}
	if path == "" {
		return "; the sections are " + strings.Join(known, ", ")
	}
	return fmt.Sprintf("; %s takes %s", path, strings.Join(known, ", "))
}

func keyEditDistance(a, b string) int {
	ra, rb := []rune(a), []rune(b)
	prev := make([]int, len(rb)+1)
	cur := make([]int, len(rb)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(ra); i++ {
		cur[0] = i
		for j := 1; j <= len(rb); j++ {
			sub := prev[j-1]
			if ra[i-1] != rb[j-1] {
				sub++
			}
			cur[j] = min(sub, prev[j]+1, cur[j-1]+1)
		}
		prev, cur = cur, prev
	}
	return prev[len(rb)]
}

func isYAMLNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

func describeYAMLNode(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.AliasNode:
		return "an alias"
	case yaml.ScalarNode:
		return quoteConfigValue(n.Value)
	}
	return "nothing"
}

func yamlKindWord(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		return "a list"
	case reflect.Float32, reflect.Float64:
		return "a number"
	}
	if t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64 {
		return "a whole number"
	}
	return "a " + t.Kind().String()
}

// quoteConfigValue quotes a value from the file for a message, cut short so that
// a pasted blob does not flood the terminal.
func quoteConfigValue(s string) string {
	const maxLen = 64
	if len(s) > maxLen {
		return strconv.Quote(s[:maxLen]) + "..."
	}
	return strconv.Quote(s)
}

// Validate fills zero fields with their defaults (see Config), then checks
// the whole Config. It returns the first problem as a *ConfigError naming
// the key; Validate cannot know lines, so only LoadConfig and ParseConfig
// add File and Line.
func (c *Config) Validate() error { return c.validate(nil) }

func (c *Config) validate(w *configWalker) error {
	c.setDefaults()
	ck := &configChecker{w: w}
	if strings.IndexFunc(c.Node.Name, unicode.IsControl) >= 0 {
		ck.failf("node.name", "%s contains control characters", quoteConfigValue(c.Node.Name))
	}
	ck.hostPort("mqtt.listen", c.MQTT.Listen)
	if c.MQTT.MaxInflight < 1 || c.MQTT.MaxInflight > 65535 {
		ck.failf("mqtt.max_inflight", "%d is out of range: MQTT's receive maximum is 1 to 65535", c.MQTT.MaxInflight)
	}
	if !c.MQTT.AllowAnonymous && c.MQTT.UsersFile == "" {
		ck.needUsers("mqtt.listen", c.MQTT.Listen)
		if !c.MQTT.TLS.RequireClientCert {
			ck.needUsers("mqtt.tls.listen", c.MQTT.TLS.Listen)
		}
		ck.needUsers("mqtt.websocket.listen", c.MQTT.WebSocket.Listen)
	}
	if c.MQTT.WebSocket.Listen != "" {
		ck.hostPort("mqtt.websocket.listen", c.MQTT.WebSocket.Listen)
	}
	if c.MQTT.WebSocket.TLS && !c.MQTT.TLS.Enabled() {
		ck.failf("mqtt.websocket.tls", "needs mqtt.tls.cert_file and key_file")
	}
	if c.MQTT.MaxQueued < 0 {
		ck.failf("mqtt.max_queued", "%d is out of range: 1 or more (0 means the default, 1000)", c.MQTT.MaxQueued)
	}
	if c.MQTT.QueueFull != "" {
		ck.oneOf("mqtt.queue_full", c.MQTT.QueueFull, "read_log", "disconnect")
	}
	if c.MQTT.MaxSubscriptions < 0 {
		ck.failf("mqtt.max_subscriptions", "%d is out of range: 1 or more (0 means the default, 1000)", c.MQTT.MaxSubscriptions)
	}
	if c.MQTT.TopicAliasMaximum < 0 || c.MQTT.TopicAliasMaximum > 65535 {
		ck.failf("mqtt.topic_alias_maximum", "%d is out of range: 1 to 65535 (0 means the default, 100)", c.MQTT.TopicAliasMaximum)
	}
	ck.tls(c.MQTT.TLS)
	ck.limits(c.MQTT)
	ck.hostPort("peer.listen", c.Peer.Listen)
	for i, a := range c.Peer.Advertise {
		ck.advertiseAddr(fmt.Sprintf("peer.advertise[%d]", i), a)
	}
	ck.hostPort("http.listen", c.HTTP.Listen)
	ck.oneOf("log.level", c.Log.Level, "debug", "info", "warn", "error")
	ck.oneOf("log.format", c.Log.Format, "text", "json")
	ck.oneOf("cluster.failover", c.Cluster.Failover, "manual", "auto")
	ck.nonNegative("cluster.failover_after", c.Cluster.FailoverAfter)
	ck.nonNegative("cluster.sync_timeout", c.Cluster.SyncTimeout)
	if c.Cluster.MinSyncReplicas < 1 || c.Cluster.MinSyncReplicas > 2 {
		ck.failf("cluster.min_sync_replicas", "%d is out of range: a sync record waits for 1 or 2 slaves (a cluster has at most 3 gateways)", c.Cluster.MinSyncReplicas)
	}
	ck.nonNegative("cluster.heartbeat", c.Cluster.Heartbeat)
	ck.nonNegative("cluster.election_timeout", c.Cluster.ElectionTimeout)
	if c.Cluster.ElectionTimeout <= 2*c.Cluster.Heartbeat {
		line := ck.w.line("cluster.election_timeout")
		if _, set := ck.lineOf("cluster.election_timeout"); !set {
			// The heartbeat set in the file made the default too short.
			line = ck.w.line("cluster.heartbeat")
		}
		ck.report("cluster.election_timeout", line, fmt.Sprintf("%s must be more than twice cluster.heartbeat (%s), or one late heartbeat starts an election",
			c.Cluster.ElectionTimeout, c.Cluster.Heartbeat))
	}
	ck.oneOf("storage.flush", c.Storage.Flush, "always", "interval")
	ck.nonNegative("storage.flush_interval", c.Storage.FlushInterval)
	ck.nonNegative("storage.max_age", c.Storage.MaxAge)
	if c.Storage.MaxBytes < MinMaxBytes {
		ck.failf("storage.max_bytes", "%s is below the least budget of %s: the WAL and the data file's reserve take 4MiB of it", c.Storage.MaxBytes, ByteSize(MinMaxBytes))
	}
	ck.topics(c.Topics)
	return ck.err
}

// tls checks the TLS listener's settings hang together; the files are read
// at start, where a missing one fails with its name.
func (ck *configChecker) tls(t TLSConfig) {
	if !t.Enabled() {
		if t.KeyFile != "" {
			ck.failf("mqtt.tls.key_file", "set without mqtt.tls.cert_file, which turns the TLS listener on")
		}
		if t.CAFile != "" {
			ck.failf("mqtt.tls.ca_file", "set without mqtt.tls.cert_file, which turns the TLS listener on")
		}
		if t.RequireClientCert || t.UseIdentityAsUsername || t.MinVersion != "" {
			ck.failf("mqtt.tls", "TLS settings without mqtt.tls.cert_file, which turns the TLS listener on")
		}
		return
	}
	ck.hostPort("mqtt.tls.listen", t.Listen)
	if t.CertFile == "" {
		ck.failf("mqtt.tls.cert_file", "missing: the TLS listener needs a server certificate")
	}
	if t.KeyFile == "" {
		ck.failf("mqtt.tls.key_file", "missing: the TLS listener needs the certificate's private key")
	}
	if t.RequireClientCert && t.CAFile == "" {
		ck.failf("mqtt.tls.require_client_cert", "needs mqtt.tls.ca_file, the CAs client certificates must chain to")
	}
	if t.UseIdentityAsUsername && !t.RequireClientCert {
		ck.failf("mqtt.tls.use_identity_as_username", "needs mqtt.tls.require_client_cert: true")
	}
	ck.oneOf("mqtt.tls.min_version", t.MinVersion, "1.2", "1.3")
}

// limits checks the MQTT limits against what the protocol can carry.
func (ck *configChecker) limits(m MQTTConfig) {
	const maxPacket = 256 << 20 // MQTT's remaining length tops out just under 256 MiB
	if m.MaxPacketSize < 256 || m.MaxPacketSize > maxPacket {
		ck.failf("mqtt.max_packet_size", "%s is out of range: 256B to 256MiB", m.MaxPacketSize)
	}
	if m.MaxClients < 1 {
		ck.failf("mqtt.max_clients", "%d is out of range: at least 1", m.MaxClients)
	}
	if m.MaxTopicLength < 1 || m.MaxTopicLength > 65535 {
		ck.failf("mqtt.max_topic_length", "%d is out of range: 1 to 65535 bytes, MQTT's longest topic", m.MaxTopicLength)
	}
	if m.MaxTopicLevels < 1 || m.MaxTopicLevels > 32768 {
		ck.failf("mqtt.max_topic_levels", "%d is out of range: 1 to 32768", m.MaxTopicLevels)
	}
	if !(m.ConnectRate > 0) || m.ConnectRate > 1e9 {
		ck.failf("mqtt.connect_rate", "%v is out of range: connections per second, more than 0", m.ConnectRate)
	}
	if m.ConnectBurst < 1 {
		ck.failf("mqtt.connect_burst", "%d is out of range: at least 1", m.ConnectBurst)
	}
	for _, k := range []struct {
		key string
		d   Duration
	}{{"mqtt.keepalive_min", m.KeepAliveMin}, {"mqtt.keepalive_max", m.KeepAliveMax}} {
		switch d := k.d.Duration(); {
		case d < 0:
			ck.failf(k.key, "%s is negative", d)
		case d%time.Second != 0:
			ck.failf(k.key, "%s is not a whole number of seconds, which is all MQTT's keep-alive can say", d)
		case d > 65535*time.Second:
			ck.failf(k.key, "%s is out of range: MQTT's keep-alive is at most 65535s (18h12m15s)", d)
		}
	}
	if m.KeepAliveMin > 0 && m.KeepAliveMax > 0 && m.KeepAliveMin > m.KeepAliveMax {
		ck.failf("mqtt.keepalive_min", "%s is more than mqtt.keepalive_max (%s)", m.KeepAliveMin, m.KeepAliveMax)
	}
}

// configChecker keeps the first validation error, so that validate reads
// as a list of rules.
type configChecker struct {
	w   *configWalker // nil when the Config did not come from a file
	err error
}

func (ck *configChecker) report(key string, line int, msg string) {
	if ck.err != nil {
		return
	}
	e := &ConfigError{Line: line, Key: key, Msg: msg}
	if ck.w != nil {
		e.File = ck.w.file
	}
	ck.err = e
}

func (ck *configChecker) failf(key, format string, args ...any) {
	ck.report(key, ck.w.line(key), fmt.Sprintf(format, args...))
}

func (ck *configChecker) lineOf(key string) (int, bool) {
	if ck.w == nil {
		return 0, false
	}
	l, ok := ck.w.lines[key]
	return l, ok
}

func (ck *configChecker) oneOf(key, v string, allowed ...string) {
	if !slices.Contains(allowed, v) {
		ck.failf(key, "%s is not one of %s", quoteConfigValue(v), strings.Join(allowed, ", "))
	}
}

func (ck *configChecker) nonNegative(key string, d Duration) {
	if d < 0 {
		ck.failf(key, "%s is negative", d)
	}
}

// hostPort splits addr and checks its parts; it reports nothing and returns
// ok=false after a failure.
func (ck *configChecker) hostPort(key, addr string) (host string, port uint64, ok bool) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		reason := err.Error()
		var ae *net.AddrError
		if errors.As(err, &ae) {
			reason = ae.Err
		}
		hint := ""
		if _, err := strconv.ParseUint(addr, 10, 16); err == nil {
			hint = fmt.Sprintf("; for every interface write \":%s\"", addr)
		}
		ck.failf(key, "%s is not host:port (%s)%s", quoteConfigValue(addr), reason, hint)
		return "", 0, false
	}
	port, err = strconv.ParseUint(p, 10, 16)
	if err != nil {
		ck.failf(key, "port %s in %s is not a number from 0 to 65535", quoteConfigValue(p), quoteConfigValue(addr))
		return "", 0, false
	}
	if _, err := netip.ParseAddr(host); err != nil && !plausibleHostName(host) {
		ck.failf(key, "host %s in %s is neither an IP address nor a host name", quoteConfigValue(host), quoteConfigValue(addr))
		return "", 0, false
	}
	return host, port, true
}

func (ck *configChecker) advertiseAddr(key, addr string) {
	host, port, ok := ck.hostPort(key, addr)
	switch {
	case !ok:
	case host == "":
		ck.failf(key, "%s has no host; other gateways dial this address", quoteConfigValue(addr))
	case port == 0:
		ck.failf(key, "%s has port 0; other gateways dial this address", quoteConfigValue(addr))
	}
}

// needUsers enforces DESIGN's rule that only a loopback MQTT listener may
// go without users, unless anonymous access is asked for by name.
func (ck *configChecker) needUsers(key, addr string) {
	host, _, err := net.SplitHostPort(addr)
	if addr == "" || err != nil || loopbackListenHost(host) {
		return
	}
	ck.failf(key, "%s is reachable from the network, which requires users: set mqtt.users_file, or mqtt.allow_anonymous: true to let any client connect", quoteConfigValue(addr))
}

func loopbackListenHost(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap().IsLoopback()
}

// plausibleHostName accepts "" (every interface) and names made of the
// characters host names use, to catch typos early; net.Listen has the last
// word at start.
func plausibleHostName(h string) bool {
	if len(h) > 253 {
		return false
	}
	for _, r := range h {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.' || r == '_') {
			return false
		}
	}
	return true
}

func (ck *configChecker) topics(rules []TopicRule) {
	first := map[string]int{}
	for i, r := range rules {
		key := fmt.Sprintf("topics[%d]", i)
		if err := checkTopicFilter(r.Match); err != nil {
			ck.failf(key+".match", "%s is not an MQTT topic filter: %v", quoteConfigValue(r.Match), err)
		}
		if r.Ack == "" {
			ck.failf(key+".ack", "missing: give sync or async")
		} else {
			ck.oneOf(key+".ack", r.Ack, "sync", "async")
		}
		j, dup := first[r.Match]
		if !dup {
			first[r.Match] = i
			continue
		}
		where := ""
		if l, ok := ck.lineOf(fmt.Sprintf("topics[%d]", j)); ok {
			where = fmt.Sprintf(" (line %d)", l)
		}
		ck.failf(key+".match", "%s repeats topics[%d]%s; the first match wins, so this rule would never apply", quoteConfigValue(r.Match), j, where)
	}
}

// checkTopicFilter applies the MQTT rules for topic filters (4.7).
func checkTopicFilter(f string) error { return mqtt.ValidFilter(f) }
