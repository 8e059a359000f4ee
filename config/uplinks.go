package config

import (
	"fmt"
	"strings"

	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/uplink"
)

// UplinkConfig is one entry of `uplinks:`: a cloud MQTT broker the
// master forwards the committed log to (and whose downlink it brings in).
// The uplink package owns the meaning of every field (uplink.Config);
// this is its YAML shape.
type UplinkConfig struct {
	// Name identifies the uplink in status, metrics, `tandem uplink pause
	// NAME` and its replicated position. Required, unique.
	Name string `yaml:"name"`
	// Broker is tcp://host:port or tls://host:port.
	Broker string `yaml:"broker"`
	// Protocol is 5 (default: messages carry the tandem-id user property)
	// or 3.1.1.
	Protocol string `yaml:"protocol"`
	// ClientID at the cloud; default "tandem-" + name.
	ClientID string `yaml:"client_id"`
	// Username and PasswordFile (its first line) authenticate at the
	// cloud.
	Username     string `yaml:"username"`
	PasswordFile string `yaml:"password_file"`
	// TLS names the PEM files of a tls:// broker; empty means the
	// system's roots and no client certificate.
	TLS UplinkTLS `yaml:"tls"`
	// Topics selects what goes up: the first rule whose match filter
	// matches a record's topic.
	Topics []UplinkTopic `yaml:"topics,omitempty"`
	// Downlink subscribes at the cloud; what arrives is published here.
	Downlink []UplinkDownlink `yaml:"downlink,omitempty"`
	// MaxInflight is how many messages may await the cloud's ack (default
	// 64).
	MaxInflight int `yaml:"max_inflight"`
	// Rate caps forwarding in messages per second (0: no cap).
	Rate float64 `yaml:"rate"`
	// MaxBacklog bounds the undelivered bytes kept for the uplink.
	// Default half of storage.max_bytes.
	MaxBacklog ByteSize `yaml:"max_backlog"`
	// OnFull is refuse (default: publishes to its topics get 0x97 while
	// the backlog is full) or drop_oldest (counted and logged).
	OnFull string `yaml:"on_full"`
	// KeepAlive is the MQTT keep alive towards the cloud (default 30s): a
	// link that answers nothing is given up after about twice this.
	KeepAlive Duration `yaml:"keepalive"`
	// ReconnectMin and ReconnectMax bound the backoff between attempts
	// (defaults 1s and 2m).
	ReconnectMin Duration `yaml:"reconnect_min"`
	ReconnectMax Duration `yaml:"reconnect_max"`
}

// UplinkTLS are the PEM files of a tls:// uplink.
type UplinkTLS struct {
	CAFile   string `yaml:"ca_file"`
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
}

// UplinkTopic forwards the records whose topic matches Match, as
// RemotePrefix + topic, at QoS (default 1).
type UplinkTopic struct {
	Match        string `yaml:"match"`
	RemotePrefix string `yaml:"remote_prefix"`
	QoS          *int   `yaml:"qos"`
}

// UplinkDownlink subscribes to Remote at the cloud (at QoS, default 1) and
// publishes what arrives as LocalPrefix + the remote topic.
type UplinkDownlink struct {
	Remote      string `yaml:"remote"`
	LocalPrefix string `yaml:"local_prefix"`
	QoS         *int   `yaml:"qos"`
}

// UplinkFilters is the gateway's one meaning of topic filters, as the
// uplinks must use it: mqtt's.
var UplinkFilters = uplink.Filters{Match: mqtt.MatchTopic, Valid: mqtt.ValidFilter}

// Uplink is u as the uplink package takes it, with max_backlog defaulted
// from the storage budget.
func (u UplinkConfig) Uplink(s StorageConfig) uplink.Config {
	c := uplink.Config{
		Name: u.Name, Broker: u.Broker, Protocol: u.Protocol, ClientID: u.ClientID,
		Username: u.Username, PasswordFile: u.PasswordFile,
		TLS:         uplink.TLSFiles{CAFile: u.TLS.CAFile, CertFile: u.TLS.CertFile, KeyFile: u.TLS.KeyFile},
		MaxInflight: u.MaxInflight, Rate: u.Rate, MaxBacklog: int64(u.MaxBacklog), OnFull: u.OnFull,
		KeepAlive: u.KeepAlive.Duration(), ReconnectMin: u.ReconnectMin.Duration(), ReconnectMax: u.ReconnectMax.Duration(),
	}
	if c.MaxBacklog == 0 {
		c.MaxBacklog = int64(s.MaxBytes / 2)
	}
	for _, t := range u.Topics {
		c.Topics = append(c.Topics, uplink.TopicRule{Match: t.Match, RemotePrefix: t.RemotePrefix, QoS: t.QoS})
	}
	for _, d := range u.Downlink {
		c.Downlink = append(c.Downlink, uplink.DownlinkRule{Remote: d.Remote, LocalPrefix: d.LocalPrefix, QoS: d.QoS})
	}
	return c
}

// uplinks checks every uplink with the uplink package's own rules, and
// that names are unique; the error names the key uplink.Validate names,
// under uplinks[i].
func (ck *configChecker) uplinks(c *Config) {
	seen := map[string]int{}
	for i, u := range c.Uplinks {
		key := fmt.Sprintf("uplinks[%d]", i)
		if err := u.Uplink(c.Storage).Validate(UplinkFilters); err != nil {
			sub, msg, ok := strings.Cut(err.Error(), ": ")
			if !ok || strings.ContainsAny(sub, " \"") {
				sub, msg = "", err.Error()
			}
			k := key
			if sub != "" {
				// "connect_timeout, reconnect_min" names two keys: point
				// at the entry.
				if f, _, _ := strings.Cut(sub, ","); f == sub {
					k = key + "." + sub
				}
			}
			ck.failf(k, "%s", msg)
			continue
		}
		if j, dup := seen[u.Name]; dup {
			ck.failf(key+".name", "%s is the name of uplinks[%d] too; names must be unique", quoteConfigValue(u.Name), j)
			continue
		}
		seen[u.Name] = i
	}
}
