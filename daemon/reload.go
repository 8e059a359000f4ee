package daemon

import (
	"crypto/tls"
	"errors"
	"fmt"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
)

// Reload re-reads what SIGHUP reloads, without dropping a connection: the
// config file's topic rules, mqtt.users_file, mqtt.acl_file and
// mqtt.allow_anonymous, the users and ACL files themselves, and the TLS
// listener's certificate, key and client CAs. Everything is read and
// checked first and swapped in only when all of it is good: on error the
// rules in force stay as they are. Other settings take effect at the next
// start.
func (d *Daemon) Reload() error {
	d.reloadMu.Lock()
	defer d.reloadMu.Unlock()
	if d.broker == nil {
		return errors.New("reload: the gateway is not running")
	}
	next := *d.live
	if d.cfg.Path() != "" {
		fresh, err := config.Load(d.cfg.Path())
		if err != nil {
			return err
		}
		// Only the reloadable keys are taken; flags given at start keep
		// overriding the rest. Validating the merge catches, say, a
		// users_file dropped under a network listener set by --mqtt.
		next.Topics = fresh.Topics
		next.MQTT.UsersFile = fresh.MQTT.UsersFile
		next.MQTT.ACLFile = fresh.MQTT.ACLFile
		next.MQTT.AllowAnonymous = fresh.MQTT.AllowAnonymous
		if err := next.Validate(); err != nil {
			return err
		}
	}
	topics, err := d.topicPolicies(next.Topics)
	if err != nil {
		return err
	}
	access, err := loadAccess(next.MQTT)
	if err != nil {
		return err
	}
	if err := d.broker.ReloadTLS(); err != nil {
		return err
	}
	d.broker.SetAccess(access)
	d.broker.SetTopics(topics)
	d.live = &next
	return nil
}

// topicPolicies turns the config's topic rules into the broker's, warning
// about sync rules, which a lone gateway cannot satisfy.
func (d *Daemon) topicPolicies(rules []config.TopicRule) ([]mqtt.TopicPolicy, error) {
	var topics []mqtt.TopicPolicy
	for _, t := range rules {
		mode, err := mqtt.ParseAckMode(t.Ack)
		if err != nil {
			return nil, fmt.Errorf("topic %q: %w", t.Match, err)
		}
		topics = append(topics, mqtt.TopicPolicy{Filter: t.Match, Ack: mode})
		if mode == mqtt.Sync {
			d.log.Warn("sync topics cannot be acked by a lone gateway: publishes to them are refused after sync_timeout", "topic", t.Match)
		}
	}
	return topics, nil
}

// loadAccess reads the users and ACL files m names; the error holds a
// keyError per file that failed.
func loadAccess(m config.MQTTConfig) (mqtt.Access, error) {
	a := mqtt.Access{AllowAnonymous: m.AnonymousAllowed()}
	var uerr, aerr error
	if m.UsersFile != "" {
		if a.Users, uerr = mqtt.LoadUsers(m.UsersFile); uerr != nil {
			uerr = keyError{"mqtt.users_file", uerr}
		}
	}
	if m.ACLFile != "" {
		if a.ACL, aerr = mqtt.LoadACL(m.ACLFile); aerr != nil {
			aerr = keyError{"mqtt.acl_file", aerr}
		}
	}
	return a, errors.Join(uerr, aerr)
}

// mqttTLS converts the TLS settings, nil when the listener is off, and
// reads the files once so that a missing or broken one stops the start
// with its name (exit 2) rather than later.
func mqttTLS(t config.TLSConfig) (*mqtt.TLSConfig, error) {
	if !t.Enabled() {
		return nil, nil
	}
	v := uint16(tls.VersionTLS12)
	if t.MinVersion == "1.3" {
		v = tls.VersionTLS13
	}
	c := &mqtt.TLSConfig{
		Listen: t.Listen, CertFile: t.CertFile, KeyFile: t.KeyFile, CAFile: t.CAFile,
		RequireClientCert: t.RequireClientCert, IdentityAsUsername: t.UseIdentityAsUsername, MinVersion: v,
	}
	return c, c.Check()
}

// mqttWebSocket converts the websocket settings, nil when the listener is
// off.
func mqttWebSocket(w config.WebSocketConfig) *mqtt.WebSocketConfig {
	if w.Listen == "" {
		return nil
	}
	return &mqtt.WebSocketConfig{Listen: w.Listen, TLS: w.TLS, OriginPatterns: w.Origins}
}

// mqttLimits converts the limits of the mqtt section.
func mqttLimits(c *config.Config) mqtt.Limits {
	m := c.MQTT
	return mqtt.Limits{
		Memory:               int64(c.Limits.Memory),
		MaxClients:           m.MaxClients,
		MaxTopicLength:       m.MaxTopicLength,
		MaxTopicLevels:       m.MaxTopicLevels,
		ConnectRate:          m.ConnectRate,
		ConnectBurst:         m.ConnectBurst,
		KeepAliveMin:         uint16(m.KeepAliveMin.Duration().Seconds()),
		KeepAliveMax:         uint16(m.KeepAliveMax.Duration().Seconds()),
		MaxClientIDLength:    m.MaxClientIDLength,
		MaxFiltersPerSession: m.MaxFiltersPerSession,
		MaxRetained:          m.MaxRetained,
		MaxRetainedBytes:     int64(c.RetainedBytes()),
		MaxSessions:          m.MaxSessions,
		MaxSessionBytes:      int64(c.SessionBytes()),

		MaxConnectionsPerAddress: m.MaxConnectionsPerAddress,
		MaxConnectionsPerUser:    m.MaxConnectionsPerUser,
	}
}

// liveConfig is the configuration in force: cfg, then each reload's.
func (d *Daemon) liveConfig() *config.Config {
	d.reloadMu.Lock()
	defer d.reloadMu.Unlock()
	return d.live
}
