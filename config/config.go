package config

import (
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// Config is the whole of tandem.yaml. Start from DefaultConfig (Load
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
	// Uplinks are the cloud brokers the committed log is forwarded to
	// (uplinks.go).
	Uplinks []UplinkConfig `yaml:"uplinks"`
	// Limits are the gateway-wide budgets no client may push it past.
	Limits LimitsConfig `yaml:"limits"`

	// file is the path Load read, which a reload (SIGHUP) reads again for
	// the topic rules and the users and ACL files; "" for a Config that did
	// not come from a file. Unexported so that it is no YAML key.
	file string
}

// Path is the file Load read this Config from, which a reload (SIGHUP)
// reads again; "" for a Config that did not come from a file.
func (c *Config) Path() string { return c.file }

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
	// MaxClientIDLength bounds a client id, in bytes; a longer one is
	// refused with CONNACK 0x85 client identifier not valid (3.1.1: 0x02
	// identifier rejected). Default 256, at most 65535.
	MaxClientIDLength int `yaml:"max_client_id_length"`
	// MaxConnectionsPerAddress caps the clients connected at once from one
	// source address (IPv4 address, IPv6 /64), loopback included; one more
	// is refused with CONNACK 0x97 quota exceeded (3.1.1: 0x03 server
	// unavailable). Default 64.
	MaxConnectionsPerAddress int `yaml:"max_connections_per_address"`
	// MaxConnectionsPerUser caps the clients connected at once under one
	// user name, as MaxConnectionsPerAddress; anonymous clients are counted
	// by address only. Default 64.
	MaxConnectionsPerUser int `yaml:"max_connections_per_user"`
	// MaxFiltersPerSession caps the subscriptions of one session; a filter
	// over it gets SUBACK 0x97 quota exceeded (3.1.1: 0x80). Subscribing
	// to a filter the session holds replaces that subscription, as MQTT
	// says, and does not count again. Default 100.
	MaxFiltersPerSession int `yaml:"max_filters_per_session"`
	// MaxRetained caps the topics with a retained message. A retained
	// publish that would add one past it gets PUBACK 0x97 quota exceeded
	// (QoS 0: dropped and counted; 3.1.1: disconnected) and is not
	// logged; replacing or clearing a topic's message is always taken.
	// Default 10000.
	MaxRetained int `yaml:"max_retained"`
	// MaxRetainedBytes caps the bytes the retained messages take in the
	// data file, pages included (a record of 1 to 2 KB takes 2 to 4 KiB
	// of them: see docs/limits.md), refused as MaxRetained past it; replacing a message is
	// taken when the bytes stay within it. Default 1/8 of
	// storage.max_bytes, at most half of it: retained messages are state
	// the log's retention cannot drop, and they count in max_bytes like
	// the log. A share rather than a fixed 32MiB: the log keeps at least
	// 7/8 of whatever budget is set (a fixed 32MiB would be half of a
	// 64MiB budget), and a larger budget (the packaged 1GiB) lets
	// retained messages grow with it; at the default 256MiB it is 32MiB.
	// Memory holds only each message's topic and the payloads up to
	// 1KiB, charged to limits.memory; larger ones are read from the
	// data file when delivered.
	MaxRetainedBytes ByteSize `yaml:"max_retained_bytes"`
	// MaxSessions caps the persistent sessions (session expiry above 0,
	// 3.1.1 clean session 0), the cluster's whole: every member holds
	// each one. A CONNECT that would start one past it gets CONNACK 0x97
	// quota exceeded (3.1.1: 0x03 server unavailable); a session resuming
	// is always taken. Default 10000.
	MaxSessions int `yaml:"max_sessions"`
	// MaxSessionBytes caps the bytes the persistent sessions keep in the
	// data file (client ids, user names, subscription filters, as
	// stored), the cluster's whole as MaxSessions. A CONNECT that would
	// start a new persistent session past it gets CONNACK 0x97 (3.1.1:
	// 0x03), a SUBSCRIBE filter that would add bytes SUBACK 0x97 (3.1.1:
	// 0x80); resuming, resubscribing and unsubscribing are always taken.
	// Default 1/8 of storage.max_bytes, at most half of it: sessions are
	// state the log's retention cannot drop, counted in max_bytes as
	// retained messages are.
	MaxSessionBytes ByteSize `yaml:"max_session_bytes"`
	// TopicAliasMaximum is how many topic aliases an MQTT 5 client may set
	// (told in the CONNACK); an alias over it ends the connection (0x94).
	// Default 100, at most 65535.
	TopicAliasMaximum int `yaml:"topic_alias_maximum"`
	// MaxQueued is how many messages a connected client's session holds
	// in memory ready to send. Default 1000.
	MaxQueued int `yaml:"max_queued"`
	// MaxQueuedBytes bounds the same queue in bytes (topic and payload,
	// and some 256 bytes a message); past it as past max_queued. A
	// message larger than it still goes alone. 0 means the default, 4MiB.
	MaxQueuedBytes ByteSize `yaml:"max_queued_bytes"`
	// MaxInflightOut is the server's outbound window per subscriber: how
	// many QoS 1/2 messages may await a client's ack, whatever Receive
	// Maximum the client gave (the smaller wins). A subscriber whose
	// window is full is handed nothing more until it acks; the rest waits
	// in the log. 0 means the default, 100.
	MaxInflightOut int `yaml:"max_inflight_out"`
	// MaxInflightOutBytes bounds that window in bytes, as MaxQueuedBytes.
	// 0 means the default, 4MiB.
	MaxInflightOutBytes ByteSize `yaml:"max_inflight_out_bytes"`
	// QueueFull says what happens to a client that falls further behind
	// than max_queued: read_log (the default) hands it the rest from the
	// log as it catches up, slowing nobody else; disconnect ends its
	// connection (MQTT 5: DISCONNECT 0x97), and a persistent session
	// resumes from its cursor when it comes back.
	QueueFull string `yaml:"queue_full"`
	// ReasonStrings says which packets carry a Reason String beside their
	// reason code: minimal (the default) the CONNACK and the DISCONNECT
	// only, the acks (PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK)
	// their bare code, as Mosquitto sends and small device stacks expect;
	// all the acks too. The log says the reason either way.
	ReasonStrings string `yaml:"reason_strings"`
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
	// Origins are the browser origins whose pages may connect:
	// "dash.example.com" (any port), "kiosk.example:8443",
	// "*.example.com", "null" (file:// pages). Unset, a listener that
	// requires credentials admits every page (a hostile one cannot log
	// in) and an anonymous one the pages of loopback and of the address
	// it is reached at (any port), so a web page cannot reach an open
	// gateway through its visitor's browser; set, they are added to the
	// latter on either.
	Origins []string `yaml:"origins,omitempty"`
}

// RetainedBytes is mqtt.max_retained_bytes, or its default when unset:
// 1/8 of storage.max_bytes (a share of a budget the file may set after
// the defaults are filled, so it is worked out here).
func (c *Config) RetainedBytes() ByteSize {
	if c.MQTT.MaxRetainedBytes > 0 {
		return c.MQTT.MaxRetainedBytes
	}
	return c.Storage.MaxBytes / 8
}

// SessionBytes is mqtt.max_session_bytes, or its default when unset: 1/8
// of storage.max_bytes, as RetainedBytes.
func (c *Config) SessionBytes() ByteSize {
	if c.MQTT.MaxSessionBytes > 0 {
		return c.MQTT.MaxSessionBytes
	}
	return c.Storage.MaxBytes / 8
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
	// MaxStrangers bounds the peer port's connections not yet proven to
	// be a member's (join and pairing knocks, handshakes under way); when
	// all are held, a newcomer from an address holding none evicts the
	// oldest of the address holding the most. Default 64.
	MaxStrangers int `yaml:"max_strangers"`
	// MaxStrangersPerAddress is what one source address (IPv6: its /64)
	// may hold of them; more are refused at once. Default 2.
	MaxStrangersPerAddress int `yaml:"max_strangers_per_address"`
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
	// MaxConns caps the connections open at once from other hosts;
	// loopback connections count too but may go a few past it, so that
	// `tandem status` on the gateway answers while strangers hold every
	// other slot. A connection over a cap is answered 503 and closed.
	// 0 means the default, 64.
	MaxConns int `yaml:"max_conns"`
	// MaxConnsPerAddress caps the connections of one other host (an IPv4
	// address, an IPv6 /64); loopback is not capped by it. 0 means the
	// default, 8.
	MaxConnsPerAddress int `yaml:"max_conns_per_address"`
	// IdleTimeout closes a kept-alive connection that sends no request
	// for this long, and bounds the wait for a request's header. 0 means
	// the default, 10s.
	IdleTimeout Duration `yaml:"idle_timeout"`
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
	// (cluster/promote.go: checkFailover). Default 10s.
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

// LimitsConfig holds the gateway-wide budgets (DESIGN.md, "Budgets").
type LimitsConfig struct {
	// Memory bounds what clients make the gateway hold in memory:
	// publishes waiting for the log, and what the broker keeps for each
	// client. Near it the connections holding the most are not read from
	// (TCP back-pressure); at it publishes get 0x97 Quota exceeded (QoS 0:
	// dropped and counted; MQTT 3.1.1: disconnected). The process needs
	// some 30-60 MiB beside it. Default 256MiB, sized for a 1 GB Raspberry
	// Pi; at least 16MiB.
	Memory ByteSize `yaml:"memory"`
}

// DefaultMemory is limits.memory when the config does not set it.
const DefaultMemory ByteSize = 256 << 20

// MinMemory is the least limits.memory accepted.
const MinMemory ByteSize = 16 << 20

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
	// MinFree is the free space the data dir's filesystem must keep: below
	// it publishes are refused (MQTT 5 0x97) until space returns, whoever
	// filled the disk. 0 means the default: 5 % of the filesystem or
	// 256MiB, whichever is smaller.
	MinFree ByteSize `yaml:"min_free"`
	// OnDamage is what a cluster member does when its data file fails its
	// checks at start (a record's CRC, a torn meta page, a truncated
	// file): resync (default) moves the damaged files aside, never
	// deleting them, and rejoins the cluster under a fresh member id,
	// taking the whole log from the master again; refuse stops with the
	// error, as a lone gateway always does (its tool is tandem repair).
	OnDamage string `yaml:"on_damage"`
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
	setDefaultIfZero(&c.MQTT.MaxClientIDLength, 256)
	setDefaultIfZero(&c.MQTT.MaxFiltersPerSession, 100)
	setDefaultIfZero(&c.MQTT.MaxConnectionsPerAddress, 64)
	setDefaultIfZero(&c.MQTT.MaxConnectionsPerUser, 64)
	if c.MQTT.TLS.CertFile != "" {
		// A certificate is the sign that TLS is wanted; 8883 is MQTT's
		// registered TLS port.
		setDefaultIfZero(&c.MQTT.TLS.Listen, ":8883")
	}
	if c.MQTT.TLS.Enabled() {
		setDefaultIfZero(&c.MQTT.TLS.MinVersion, "1.2")
	}
	setDefaultIfZero(&c.Limits.Memory, DefaultMemory)
	setDefaultIfZero(&c.Peer.Listen, "127.0.0.1:7883")
	setDefaultIfZero(&c.Peer.MaxStrangers, 64)
	setDefaultIfZero(&c.Peer.MaxStrangersPerAddress, 2)
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
	setDefaultIfZero(&c.Storage.OnDamage, "resync")
	setDefaultIfZero(&c.Storage.MaxBytes, DefaultMaxBytes)
	setDefaultIfZero(&c.MQTT.MaxRetained, 10000)
	setDefaultIfZero(&c.MQTT.MaxSessions, 10000)
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

// Load reads the YAML file at path on top of DefaultConfig and
// validates the result. Every error is a *ConfigError naming path, and the
// key and line when there are some; a read error is wrapped in it, so
// errors.Is(err, fs.ErrNotExist) still works.
func Load(path string) (*Config, error) {
	c, err := LoadAll(path)
	if err != nil {
		return nil, err
	}
	return c, nil
}

// Parse is Load on data already in memory; name is used as the
// file name in errors. An empty document gives the defaults, and so does a
// key with no value. Unknown keys, a second YAML document and merge keys
// ("<<") are errors.
func Parse(data []byte, name string) (*Config, error) {
	c, err := parse(data, name)
	if err != nil {
		return nil, err
	}
	return c, nil
}

// parse is Parse returning, with the errors, the Config as far as the file
// could be read: every key the walk found wrong is left out (it keeps its
// default) and the rest is decoded and validated, so that one run reports
// every error. nil when the file is no YAML mapping at all.
func parse(data []byte, name string) (*Config, error) {
	w := &configWalker{file: name, lines: map[string]int{}}
	root, err := w.parse(data)
	if err != nil {
		return nil, err
	}
	cfg := DefaultConfig()
	if root != nil {
		// Walking first gives errors with key paths; yaml.v3's own say
		// "field listn not found in type daemon.MQTTConfig". The walk
		// drops what it found wrong from the tree, so the rest decodes.
		w.walk(root, reflect.TypeFor[Config](), "", 0)
		if err := root.Decode(cfg); err != nil {
			// Unreachable while the walk checks what the decoder checks;
			// kept so a gap between them still yields a ConfigError.
			w.errs.add(w.decodeError(err))
			return nil, w.errs.Err()
		}
	}
	var verr ErrorList
	verr.add(cfg.validate(w))
	all := w.errs
	for _, e := range verr {
		if !coveredBy(w.errs, e.Key) {
			all = append(all, e)
		}
	}
	return cfg, all.Err()
}

// coveredBy reports whether key, or a key it lies under, has an error in l
// already: validating a value the walk left out repeats it.
func coveredBy(l ErrorList, key string) bool {
	for _, e := range l {
		if e.Key != "" && (key == e.Key || strings.HasPrefix(key, e.Key+".") || strings.HasPrefix(key, e.Key+"[")) {
			return true
		}
	}
	return false
}

// ConfigError is the error of Load, Parse and Validate. The CLI
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

// UsageError marks an error the caller made rather than the gateway: a bad
// flag, a bad config value, a bad API request. The CLI exits 2 for it (as
// for a ConfigError) and the admin API answers 400. It lives here, beside
// ConfigError, because every layer that checks input (cli, admin, daemon,
// cluster) imports config.
type UsageError struct{ Err error }

// Error returns Err's message.
func (e UsageError) Error() string { return e.Err.Error() }

// Unwrap returns Err.
func (e UsageError) Unwrap() error { return e.Err }
