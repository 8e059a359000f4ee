package config

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/tandem-edge/tandem/mqtt"
)

// Validate fills zero fields with their defaults (see Config), then checks
// the whole Config. It returns every problem: one as a *ConfigError naming
// the key, several as an ErrorList of them; Validate cannot know lines
// (unless the Config came from Load), so Load and Parse add File and Line.
func (c *Config) Validate() error {
	return c.validate(c.walker())
}

func (c *Config) validate(w *configWalker) error {
	ck := &configChecker{w: w}
	ck.explicitZeros(c) // before the defaults fill them
	c.setDefaults()
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
	if c.MQTT.MaxInflightOut < 0 || c.MQTT.MaxInflightOut > 65535 {
		ck.failf("mqtt.max_inflight_out", "%d is out of range: 1 to 65535 (0 means the default, 100)", c.MQTT.MaxInflightOut)
	}
	ck.subscriberBytes(c)
	if c.MQTT.QueueFull != "" {
		ck.oneOf("mqtt.queue_full", c.MQTT.QueueFull, "read_log", "disconnect")
	}
	if c.MQTT.ReasonStrings != "" {
		ck.oneOf("mqtt.reason_strings", c.MQTT.ReasonStrings, "minimal", "all")
	}
	if c.MQTT.MaxFiltersPerSession < 1 {
		ck.failf("mqtt.max_filters_per_session", "%d is out of range: 1 or more (default 100)", c.MQTT.MaxFiltersPerSession)
	}
	if c.MQTT.MaxRetained < 1 {
		ck.failf("mqtt.max_retained", "%d is out of range: 1 or more (default 10000)", c.MQTT.MaxRetained)
	}
	if c.MQTT.MaxSessions < 1 {
		ck.failf("mqtt.max_sessions", "%d is out of range: 1 or more (default 10000)", c.MQTT.MaxSessions)
	}
	if c.MQTT.MaxRetainedBytes > c.Storage.MaxBytes/2 {
		ck.failf("mqtt.max_retained_bytes", "%s is more than half of storage.max_bytes (%s): retained messages count in it, and the log needs the rest", c.MQTT.MaxRetainedBytes, c.Storage.MaxBytes)
	}
	if c.MQTT.MaxSessionBytes > c.Storage.MaxBytes/2 {
		ck.failf("mqtt.max_session_bytes", "%s is more than half of storage.max_bytes (%s): persistent sessions count in it, and the log needs the rest", c.MQTT.MaxSessionBytes, c.Storage.MaxBytes)
	} else if c.MQTT.MaxRetainedBytes <= c.Storage.MaxBytes/2 && c.RetainedBytes()+c.SessionBytes() > c.Storage.MaxBytes*3/4 {
		ck.failf("mqtt.max_session_bytes", "%s with mqtt.max_retained_bytes %s is more than 3/4 of storage.max_bytes (%s): both count in it, and the log needs the rest", c.SessionBytes(), c.RetainedBytes(), c.Storage.MaxBytes)
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
	if c.Peer.MaxStrangers < 2 || c.Peer.MaxStrangers > 65536 {
		ck.failf("peer.max_strangers", "%d is out of range: 2 to 65536 (a join from a fresh address needs a slot beside a flood's)", c.Peer.MaxStrangers)
	}
	if c.Peer.MaxStrangersPerAddress < 1 || c.Peer.MaxStrangersPerAddress > c.Peer.MaxStrangers {
		ck.failf("peer.max_strangers_per_address", "%d is out of range: 1 to peer.max_strangers (%d)", c.Peer.MaxStrangersPerAddress, c.Peer.MaxStrangers)
	}
	ck.hostPort("http.listen", c.HTTP.Listen)
	if c.HTTP.MaxConns < 0 {
		ck.failf("http.max_conns", "%d is out of range: 1 or more (0 means the default, 64)", c.HTTP.MaxConns)
	}
	if c.HTTP.MaxConnsPerAddress < 0 {
		ck.failf("http.max_conns_per_address", "%d is out of range: 1 or more (0 means the default, 8)", c.HTTP.MaxConnsPerAddress)
	}
	ck.nonNegative("http.idle_timeout", c.HTTP.IdleTimeout)
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
	ck.oneOf("storage.on_damage", c.Storage.OnDamage, "resync", "refuse")
	ck.nonNegative("storage.max_age", c.Storage.MaxAge)
	if c.Limits.Memory < MinMemory {
		ck.failf("limits.memory", "%s is below the least budget of %s", c.Limits.Memory, ByteSize(MinMemory))
	}
	if c.Storage.MaxBytes < MinMaxBytes {
		ck.failf("storage.max_bytes", "%s is below the least budget of %s: the WAL and the data file's reserve take 4MiB of it", c.Storage.MaxBytes, ByteSize(MinMaxBytes))
	}
	ck.topics(c.Topics)
	ck.uplinks(c)
	ck.ports(c)
	return ck.errs.Err()
}

// explicitZeros refuses a 0 written in the file for a key whose range
// excludes 0 and whose default setDefaults fills. An omitted key is 0
// until then, so Validate cannot tell the two apart by value: it took
// `max_inflight: 0` for the default 1024, silently. Only keys set in the
// file (which a walker knows) are refused; a Config built in code keeps
// "zero means the default". Not here: keys where 0 means "off"
// (mqtt.keepalive_min and keepalive_max: no bound; storage.max_age: kept
// whatever their age; an uplink's rate: no cap), and those whose default
// is applied where they are used, for which the effective config prints
// 0 and says so ("0 means the default": mqtt.max_queued, max_queued_bytes,
// max_inflight_out, max_inflight_out_bytes, topic_alias_maximum,
// max_retained_bytes, http.max_conns, max_conns_per_address, idle_timeout,
// storage.min_free).
func (ck *configChecker) explicitZeros(c *Config) {
	m, cl, st := &c.MQTT, &c.Cluster, &c.Storage
	for _, k := range []struct {
		key, want string
		zero      bool
	}{
		{"mqtt.max_inflight", "1 to 65535, MQTT's receive maximum", m.MaxInflight == 0},
		{"mqtt.max_packet_size", "256B to 256MiB", m.MaxPacketSize == 0},
		{"mqtt.max_clients", "at least 1", m.MaxClients == 0},
		{"mqtt.max_topic_length", "1 to 65535 bytes", m.MaxTopicLength == 0},
		{"mqtt.max_topic_levels", "1 to 32768", m.MaxTopicLevels == 0},
		{"mqtt.connect_rate", "connections per second, more than 0", m.ConnectRate == 0},
		{"mqtt.connect_burst", "at least 1", m.ConnectBurst == 0},
		{"mqtt.max_client_id_length", "1 to 65535 bytes", m.MaxClientIDLength == 0},
		{"mqtt.max_connections_per_address", "at least 1", m.MaxConnectionsPerAddress == 0},
		{"mqtt.max_connections_per_user", "at least 1", m.MaxConnectionsPerUser == 0},
		{"mqtt.max_filters_per_session", "1 or more", m.MaxFiltersPerSession == 0},
		{"mqtt.max_retained", "1 or more", m.MaxRetained == 0},
		{"mqtt.max_sessions", "1 or more", m.MaxSessions == 0},
		{"limits.memory", "at least " + ByteSize(MinMemory).String(), c.Limits.Memory == 0},
		{"peer.max_strangers", "2 to 65536", c.Peer.MaxStrangers == 0},
		{"peer.max_strangers_per_address", "1 to peer.max_strangers", c.Peer.MaxStrangersPerAddress == 0},
		{"cluster.failover_after", "more than 0", cl.FailoverAfter == 0},
		{"cluster.sync_timeout", "more than 0", cl.SyncTimeout == 0},
		{"cluster.min_sync_replicas", "1 or 2", cl.MinSyncReplicas == 0},
		{"cluster.heartbeat", "more than 0", cl.Heartbeat == 0},
		{"cluster.election_timeout", "more than twice cluster.heartbeat", cl.ElectionTimeout == 0},
		{"storage.flush_interval", "more than 0", st.FlushInterval == 0},
		{"storage.max_bytes", "at least " + ByteSize(MinMaxBytes).String(), st.MaxBytes == 0},
	} {
		if _, set := ck.lineOf(k.key); set && k.zero {
			ck.failf(k.key, "0 is out of range: %s (leave the key out for its default)", k.want)
		}
	}
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
	if m.MaxConnectionsPerAddress < 1 {
		ck.failf("mqtt.max_connections_per_address", "%d is out of range: at least 1", m.MaxConnectionsPerAddress)
	}
	if m.MaxConnectionsPerUser < 1 {
		ck.failf("mqtt.max_connections_per_user", "%d is out of range: at least 1", m.MaxConnectionsPerUser)
	}
	if m.MaxClientIDLength < 1 || m.MaxClientIDLength > 65535 {
		ck.failf("mqtt.max_client_id_length", "%d is out of range: 1 to 65535 bytes, MQTT's longest string", m.MaxClientIDLength)
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

// configChecker collects the validation errors, so that validate reads as
// a list of rules and reports every broken one.
type configChecker struct {
	w    *configWalker // nil when the Config did not come from a file
	errs ErrorList
}

func (ck *configChecker) report(key string, line int, msg string) {
	e := &ConfigError{Line: line, Key: key, Msg: msg}
	if ck.w != nil {
		e.File = ck.w.file
	}
	ck.errs = append(ck.errs, e)
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

// subscriberBytes checks that one subscriber's queue and in-flight window
// fit in half of limits.memory: a session holding more is disconnected
// (0x97), so bounds above it would end every slow subscriber.
func (ck *configChecker) subscriberBytes(c *Config) {
	const def = 4 << 20
	q, w := c.MQTT.MaxQueuedBytes, c.MQTT.MaxInflightOutBytes
	if q == 0 {
		q = def
	}
	if w == 0 {
		w = def
	}
	if q+w <= c.Limits.Memory/2 || c.Limits.Memory < MinMemory {
		return // a budget below its least is reported on its own
	}
	key := "limits.memory"
	for _, k := range []string{"mqtt.max_inflight_out_bytes", "mqtt.max_queued_bytes"} {
		if _, set := ck.lineOf(k); set {
			key = k
		}
	}
	ck.failf(key, "mqtt.max_queued_bytes (%s) and mqtt.max_inflight_out_bytes (%s) together are more than half of limits.memory (%s): a subscriber holding more is disconnected, so every slow one would be",
		ByteSize(q), ByteSize(w), c.Limits.Memory)
}
