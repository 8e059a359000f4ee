package uplink

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"
)

// Config is one uplink: a cloud MQTT broker, what of the log goes there and
// what comes back. Field names follow the contract's `uplinks:` keys; the
// config package decodes YAML into it and calls Validate.
type Config struct {
	// Name identifies the uplink in status, metrics, `tandem uplink pause
	// NAME` and the replicated position. Required, unique per gateway.
	Name string
	// Broker is tcp://host:port or tls://host:port.
	Broker string
	// Protocol is "5" (default) or "3.1.1" (for clouds that speak only
	// that: its messages cannot carry the tandem-id user property).
	Protocol string
	// ClientID at the cloud; default "tandem-" + Name.
	ClientID string
	// Username and PasswordFile (the password is the file's content with
	// trailing newlines cut) authenticate at the cloud.
	Username     string
	PasswordFile string
	// TLS for tls:// brokers; empty fields mean the system roots and no
	// client certificate.
	TLS TLSFiles
	// Topics selects what is forwarded: a record goes up under the first
	// rule whose Match filter matches its topic.
	Topics []TopicRule
	// Downlink subscribes at the cloud; what arrives is published locally.
	Downlink []DownlinkRule
	// MaxInflight is how many messages may await the cloud's ack (default
	// 64). One connection and one window keep log order on the wire.
	MaxInflight int
	// Rate caps forwarding in messages per second (0: no cap): a replay
	// after a long cut must not eat the whole cellular link.
	Rate float64
	// MaxBacklog is the most bytes of undelivered records kept for the
	// uplink (0: no bound; the daemon defaults it to half of
	// storage.max_bytes). Past it OnFull decides.
	MaxBacklog int64
	// OnFull is "refuse" (default: publishes to the uplink's topics are
	// refused while the backlog is full) or "drop_oldest" (the uplink
	// skips its oldest undelivered records, counted).
	OnFull string

	// KeepAlive is the MQTT keep alive: a link that accepts TCP but
	// answers nothing is given up after about twice this (default 30s;
	// whole seconds).
	KeepAlive time.Duration
	// ConnectTimeout bounds dial + CONNECT + CONNACK (default 10s).
	ConnectTimeout time.Duration
	// ReconnectMin and ReconnectMax bound the exponential backoff with
	// jitter between connection attempts (defaults 1s and 2m).
	ReconnectMin, ReconnectMax time.Duration
	// SessionExpiry is asked of the cloud when there is a downlink, so
	// that commands sent while the link is down wait there (default 24h).
	// Without a downlink every connection starts clean.
	SessionExpiry time.Duration
}

// TLSFiles name the PEM files of a tls:// uplink.
type TLSFiles struct {
	CAFile   string // roots to trust; empty: the system's
	CertFile string // client certificate; with KeyFile
	KeyFile  string
}

// TopicRule forwards records whose topic matches Match, as RemotePrefix +
// topic, at QoS (nil: 1).
type TopicRule struct {
	Match        string
	RemotePrefix string
	QoS          *int
}

// DownlinkRule subscribes to Remote at the cloud (at QoS, nil: 1) and
// publishes what arrives locally as LocalPrefix + the remote topic.
type DownlinkRule struct {
	Remote      string
	LocalPrefix string
	QoS         *int
}

// On-full policies.
const (
	OnFullRefuse     = "refuse"
	OnFullDropOldest = "drop_oldest"
)

// DefaultConfig is an uplink with every default filled in but no name,
// broker or topics.
func DefaultConfig() Config {
	return Config{
		Protocol:       "5",
		MaxInflight:    64,
		OnFull:         OnFullRefuse,
		KeepAlive:      30 * time.Second,
		ConnectTimeout: 10 * time.Second,
		ReconnectMin:   time.Second,
		ReconnectMax:   2 * time.Minute,
		SessionExpiry:  24 * time.Hour,
	}
}

// withDefaults fills zero fields from DefaultConfig, so a Config built by
// hand works too.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.Protocol == "" {
		c.Protocol = d.Protocol
	}
	if c.ClientID == "" {
		c.ClientID = "tandem-" + c.Name
	}
	if c.MaxInflight == 0 {
		c.MaxInflight = d.MaxInflight
	}
	if c.OnFull == "" {
		c.OnFull = d.OnFull
	}
	if c.KeepAlive == 0 {
		c.KeepAlive = d.KeepAlive
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = d.ConnectTimeout
	}
	if c.ReconnectMin == 0 {
		c.ReconnectMin = d.ReconnectMin
	}
	if c.ReconnectMax == 0 {
		c.ReconnectMax = max(d.ReconnectMax, 2*c.ReconnectMin)
	}
	if c.SessionExpiry == 0 {
		c.SessionExpiry = d.SessionExpiry
	}
	return c
}

// Filters is the gateway's one meaning of MQTT topic filters. The daemon
// passes mqtt's (mqtt.MatchTopic, mqtt.ValidFilter), so that an uplink's
// topics, the broker's subscriptions and the topic rules agree.
type Filters struct {
	Match func(filter, topic string) bool
	Valid func(filter string) error // nil: filters are not checked
}

// Validate reports the first thing wrong with c (after defaults), naming
// the key as the YAML spells it; f.Valid checks the filters.
func (c Config) Validate(f Filters) error {
	c = c.withDefaults()
	if c.Name == "" {
		return errors.New("name: required")
	}
	if _, _, err := brokerAddr(c.Broker); err != nil {
		return fmt.Errorf("broker: %w", err)
	}
	switch c.Protocol {
	case "5", "3.1.1":
	default:
		return fmt.Errorf("protocol: %q is not 5 or 3.1.1", c.Protocol)
	}
	if len(c.Topics) == 0 && len(c.Downlink) == 0 {
		return errors.New("topics: an uplink needs topics or a downlink")
	}
	qos2 := false
	for i, t := range c.Topics {
		if err := f.valid(t.Match); err != nil {
			return fmt.Errorf("topics[%d].match: %w", i, err)
		}
		if strings.ContainsAny(t.RemotePrefix, "+#") {
			return fmt.Errorf("topics[%d].remote_prefix: %q has a wildcard", i, t.RemotePrefix)
		}
		if q := ruleQoS(t.QoS); q < 0 || q > 2 {
			return fmt.Errorf("topics[%d].qos: %d is not 0, 1 or 2", i, q)
		} else if q == 2 {
			qos2 = true
		}
	}
	for i, d := range c.Downlink {
		if err := f.valid(d.Remote); err != nil {
			return fmt.Errorf("downlink[%d].remote: %w", i, err)
		}
		if strings.ContainsAny(d.LocalPrefix, "+#") || strings.HasPrefix(d.LocalPrefix, "$") {
			return fmt.Errorf("downlink[%d].local_prefix: %q has a wildcard or starts with $", i, d.LocalPrefix)
		}
		if q := ruleQoS(d.QoS); q < 0 || q > 2 {
			return fmt.Errorf("downlink[%d].qos: %d is not 0, 1 or 2", i, q)
		}
	}
	// A downlink keeps the cloud session across connections, while the
	// forwarding side starts packet ids afresh on each one: a QoS 2 id
	// the cloud still holds from the last connection would swallow a new
	// message. Two uplink entries (two client ids) do both.
	if qos2 && len(c.Downlink) > 0 {
		return errors.New("topics: qos 2 forwarding cannot share an uplink with a downlink; give the downlink an uplink entry of its own")
	}
	if c.MaxInflight < 1 || c.MaxInflight > 65535 {
		return fmt.Errorf("max_inflight: %d is not within 1..65535", c.MaxInflight)
	}
	if c.Rate < 0 {
		return fmt.Errorf("rate: %v is negative", c.Rate)
	}
	if c.MaxBacklog < 0 {
		return fmt.Errorf("max_backlog: %d is negative", c.MaxBacklog)
	}
	if c.OnFull != OnFullRefuse && c.OnFull != OnFullDropOldest {
		return fmt.Errorf("on_full: %q is not refuse or drop_oldest", c.OnFull)
	}
	if c.KeepAlive < time.Second || c.KeepAlive > 65535*time.Second {
		return fmt.Errorf("keepalive: %v is not within 1s..65535s", c.KeepAlive)
	}
	if c.ConnectTimeout < 0 || c.ReconnectMin < 0 {
		return errors.New("connect_timeout, reconnect_min: negative")
	}
	if c.ReconnectMax <= c.ReconnectMin {
		return fmt.Errorf("reconnect_max: %v is not above reconnect_min %v", c.ReconnectMax, c.ReconnectMin)
	}
	return nil
}

// ruleQoS is a rule's QoS with the default (1) for none.
func ruleQoS(q *int) int {
	if q == nil {
		return 1
	}
	return *q
}

// brokerAddr splits tcp://host:port or tls://host:port.
func brokerAddr(broker string) (scheme, addr string, err error) {
	u, err := url.Parse(broker)
	if err != nil {
		return "", "", err
	}
	switch u.Scheme {
	case "tcp", "tls":
	case "":
		return "", "", fmt.Errorf("%q: want tcp://host:port or tls://host:port", broker)
	default:
		return "", "", fmt.Errorf("%q: scheme %s is not tcp or tls", broker, u.Scheme)
	}
	if u.Port() == "" || u.Hostname() == "" {
		return "", "", fmt.Errorf("%q: want host:port", broker)
	}
	if u.Path != "" && u.Path != "/" {
		return "", "", fmt.Errorf("%q: a broker address has no path", broker)
	}
	return u.Scheme, u.Host, nil
}

// valid checks a filter with f.Valid, if there is one.
func (f Filters) valid(filter string) error {
	if filter == "" {
		return errors.New("empty filter")
	}
	if f.Valid == nil {
		return nil
	}
	return f.Valid(filter)
}
