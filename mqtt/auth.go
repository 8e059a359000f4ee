package mqtt

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Access is who may connect and what they may do: the part of the broker's
// configuration a reload (SIGHUP) replaces while clients stay connected.
type Access struct {
	// AllowAnonymous admits clients that prove no user name.
	AllowAnonymous bool
	// Users is the users file; nil means none, and then user names are
	// not checked, nor trusted: such clients count as anonymous.
	Users *Users
	// ACL is the ACL file; nil allows every client every topic.
	ACL *ACL
}

// TLSConfig configures the MQTT-over-TLS listener.
type TLSConfig struct {
	// Listen is the listener's host:port.
	Listen string
	// CertFile and KeyFile are the PEM server certificate (chain) and key.
	CertFile, KeyFile string
	// CAFile is a PEM bundle of the CAs that sign client certificates;
	// with it, a client certificate that is presented is verified.
	CAFile string
	// RequireClientCert refuses clients without a valid certificate in
	// the TLS handshake (an expired or untrusted one fails it too).
	RequireClientCert bool
	// IdentityAsUsername makes a verified client certificate's common name
	// the client's user name, as Mosquitto's use_identity_as_username: the
	// certificate is the credential, and no password is asked.
	IdentityAsUsername bool
	// MinVersion is the lowest TLS version accepted; 0 means TLS 1.2.
	MinVersion uint16
}

// errRefused is what the guard returns from mochi's OnConnect for a client
// it refused: the CONNACK, if any, is written, and the refusal logged.
var errRefused = errors.New("mqtt: client refused")

// guard is the mochi hook that decides who may connect, what they may read
// and how big their topics may be. It is registered before the other hooks,
// so its OnPacketRead runs first and its refusals stop a packet before the
// ingest hook logs it. Publishes are checked by canPublish, which ingest
// calls in order with the acks it owes.
type guard struct {
	mochi.HookBase
	b *Broker
}

// ID names the hook to mochi.
func (g *guard) ID() string { return "tandem-guard" }

// Provides lists the events the guard handles.
func (g *guard) Provides(b byte) bool {
	switch b {
	case mochi.OnConnect, mochi.OnConnectAuthenticate, mochi.OnACLCheck, mochi.OnPacketRead,
		mochi.OnSubscribe, mochi.OnPacketEncode, mochi.OnWill:
		return true
	}
	return false
}

// OnConnect authenticates the client and checks its keep-alive and will.
// It does the work of OnConnectAuthenticate, which can only answer yes or
// no, so that each refusal gets the CONNACK code that fits it.
func (g *guard) OnConnect(cl *mochi.Client, pk packets.Packet) error {
	b := g.b
	v5 := cl.Properties.ProtocolVersion == 5
	if ka, ok := b.cfg.Limits.keepAlive(pk.Connect.Keepalive); !ok {
		if !v5 {
			return g.refuse(cl, packets.ErrClientIdentifierNotValid, 0x02, "keep-alive out of bounds", "keepalive", pk.Connect.Keepalive)
		}
		cl.State.Keepalive = ka
		cl.State.ServerKeepalive = true // sent as the CONNACK's server keep alive
	}

	acc := b.access.Load()
	var user string // the user name the client proved, "" for none
	switch cert := peerCertificate(cl); {
	case cert != nil && cl.Net.Listener == tlsListenerID && b.cfg.TLS.IdentityAsUsername:
		user = cert.Subject.CommonName
		if user == "" {
			return g.refuse(cl, packets.ErrNotAuthorized, 0x05, "client certificate without a common name")
		}
	case pk.Connect.UsernameFlag && acc.Users != nil:
		name := string(pk.Connect.Username)
		if !b.checkPassword(acc.Users, name, pk.Connect.Password) {
			return g.refuse(cl, packets.ErrBadUsernameOrPassword, 0x04, "bad user name or password", "user", name)
		}
		user = name
	}
	if user == "" && !acc.AllowAnonymous {
		return g.refuse(cl, packets.ErrNotAuthorized, 0x05, "anonymous client not allowed")
	}
	// An unproven user name must not pick an ACL section.
	cl.Properties.Username = []byte(user)
	// A session belongs to the user who made it: taking over another
	// user's client id would inherit its subscriptions and in-flight
	// messages, which mochi resends without an ACL check.
	if old, ok := b.srv.Clients.Get(cl.ID); ok && string(old.Properties.Username) != user {
		return g.refuse(cl, packets.ErrClientIdentifierNotValid, 0x02, "client id held by another user's session")
	}

	if pk.Connect.WillFlag {
		topic := pk.Connect.WillTopic
		if why := b.cfg.Limits.topicProblem(topic); why != "" {
			if !v5 {
				// 3.1.1 has no CONNACK code for it [MQTT-3.2.2-6].
				return g.refuse(cl, packets.Code{}, 0, "will "+why)
			}
			return g.refuse(cl, packets.ErrTopicNameInvalid, 0, "will "+why)
		}
		if !acc.ACL.Allowed(user, cl.ID, topic, true) {
			return g.refuse(cl, packets.ErrNotAuthorized, 0x05, "will topic denied by ACL", "topic", topic)
		}
	}
	return nil
}

// refuse writes a refusing CONNACK (code5 to MQTT 5 clients, code3 to
// older ones; none when that code is zero), logs the refusal once a
// minute per reason and address, and returns the error that makes mochi
// drop the connection.
func (g *guard) refuse(cl *mochi.Client, code5 packets.Code, code3 byte, reason string, args ...any) error {
	ack := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack}}
	if cl.Properties.ProtocolVersion == 5 {
		ack.ReasonCode = code5.Code
		ack.Properties.ReasonString = code5.Reason
	} else {
		ack.ReasonCode = code3
	}
	if ack.ReasonCode != 0 {
		_ = cl.WritePacket(ack)
	}
	g.b.refusedConns.Store(cl.Net.Conn, true)
	g.b.refusal(sourceKey(cl.Net.Conn.RemoteAddr()), reason, append(args, "client", cl.ID, "remote", cl.Net.Remote)...)
	return errRefused
}

// OnConnectAuthenticate admits every client OnConnect let through.
// mochi ORs this hook across hooks: any hook saying yes admits the client.
func (g *guard) OnConnectAuthenticate(*mochi.Client, packets.Packet) bool { return true }

// OnACLCheck answers mochi's read checks: each filter of a SUBSCRIBE (a
// refusal is that filter's SUBACK 0x87, or 0x80 for MQTT 3.1.1) and each
// message about to be delivered, retained ones included, so a subscription
// granted before a reload stops delivering what the new ACL forbids. Write
// checks answer yes: canPublish decides, in order with the acks the client
// is owed, where mochi would ack out of order.
func (g *guard) OnACLCheck(cl *mochi.Client, topic string, write bool) bool {
	if write {
		return true
	}
	acl := g.b.access.Load().ACL
	if acl == nil {
		return true
	}
	// "$share" is matched without regard to case, as mochi does.
	if first, rest, ok := strings.Cut(topic, "/"); ok && strings.EqualFold(first, "$share") {
		if _, f, ok := strings.Cut(rest, "/"); ok {
			topic = f // a shared subscription's filter is what is read
		}
	}
	if acl.Allowed(string(cl.Properties.Username), cl.ID, topic, false) {
		return true
	}
	g.b.refusal(cl.ID, "read denied by ACL", "client", cl.ID, "topic", topic)
	return false
}

// canPublish reports whether cl may publish to topic. The ingest hook asks
// it for every PUBLISH, so a refusal is acked in order with the others
// (MQTT 5: reason 0x87; 3.1.1, which has no negative ack: disconnected).
func (b *Broker) canPublish(cl *mochi.Client, topic string) bool {
	if b.access.Load().ACL.Allowed(string(cl.Properties.Username), cl.ID, topic, true) {
		return true
	}
	b.refusal(cl.ID, "publish denied by ACL", "client", cl.ID, "topic", topic)
	return false
}

// OnPacketRead disconnects a client whose PUBLISH topic exceeds the limits:
// MQTT 5 with DISCONNECT 0x90 (topic name invalid), 3.1.1 by closing the
// connection, its only way. A topic alias with no topic was checked when
// the alias was set.
func (g *guard) OnPacketRead(cl *mochi.Client, pk packets.Packet) (packets.Packet, error) {
	if pk.FixedHeader.Type != packets.Publish {
		return pk, nil
	}
	why := g.b.cfg.Limits.topicProblem(pk.TopicName)
	if why == "" {
		return pk, nil
	}
	g.b.refusedConns.Store(cl.Net.Conn, true)
	g.b.refusal(sourceKey(cl.Net.Conn.RemoteAddr()), why+": disconnected", "client", cl.ID, "topic", truncate(pk.TopicName))
	if cl.Properties.ProtocolVersion == 5 {
		_ = g.b.srv.DisconnectClient(cl, packets.ErrTopicNameInvalid)
	} else {
		cl.Stop(packets.ErrTopicNameInvalid)
	}
	return pk, packets.ErrRejectPacket // ends the read loop
}

// OnSubscribe turns each filter over the limits into an invalid one, so
// that mochi answers it, and only it, with SUBACK 0x8F (topic filter
// invalid; 0x80 for MQTT 3.1.1).
func (g *guard) OnSubscribe(cl *mochi.Client, pk packets.Packet) packets.Packet {
	for i := range pk.Filters {
		if why := g.b.cfg.Limits.topicProblem(pk.Filters[i].Filter); why != "" {
			g.b.refusal(cl.ID, why+": subscription refused", "client", cl.ID, "filter", truncate(pk.Filters[i].Filter))
			pk.Filters[i].Filter = "" // mochi refuses an empty filter [MQTT-4.7.3-1]
		}
	}
	return pk
}

// OnPacketEncode tells MQTT 5 clients the maximum packet size in the
// CONNACK, which mochi leaves out: a client that knows it can refuse a
// too-big publish itself instead of losing its connection.
func (g *guard) OnPacketEncode(cl *mochi.Client, pk packets.Packet) packets.Packet {
	if pk.FixedHeader.Type == packets.Connack && cl.Properties.ProtocolVersion == 5 && pk.ReasonCode < 0x80 {
		pk.Properties.MaximumPacketSize = g.b.cfg.MaxPacketSize
	}
	return pk
}

// OnWill checks the will against the ACL as it stands when the will is
// sent, which a reload may have changed since CONNECT; a refused will
// leaves with no topic, which the ingest hook drops.
func (g *guard) OnWill(cl *mochi.Client, will mochi.Will) (mochi.Will, error) {
	if will.TopicName == "" || g.b.access.Load().ACL.Allowed(string(cl.Properties.Username), cl.ID, will.TopicName, true) {
		return will, nil
	}
	g.b.refusal(cl.ID, "will denied by ACL: dropped", "client", cl.ID, "topic", will.TopicName)
	return mochi.Will{Flag: will.Flag}, nil
}

// checkPassword runs the bcrypt comparison, at most a few at a time: each
// one is tens of milliseconds of CPU (more on ARM), and a flood of CONNECTs
// must not take the CPU the log needs.
// A client that waits longer than the connect deadline for its turn is
// refused rather than queued without end.
func (b *Broker) checkPassword(u *Users, user string, password []byte) bool {
	t := time.NewTimer(b.cfg.Limits.ConnectTimeout)
	defer t.Stop()
	select {
	case b.bcryptSem <- struct{}{}:
	case <-t.C:
		return false
	}
	defer func() { <-b.bcryptSem }()
	return u.Check(user, password)
}

// peerCertificate returns the verified client certificate of a TLS
// connection, or nil.
func peerCertificate(cl *mochi.Client) *x509.Certificate {
	tc, ok := cl.Net.Conn.(*tls.Conn)
	if !ok {
		return nil
	}
	st := tc.ConnectionState()
	if len(st.VerifiedChains) == 0 || len(st.PeerCertificates) == 0 {
		return nil
	}
	return st.PeerCertificates[0]
}

// Check reads the files of c as the listener would, so that a missing or
// broken one is reported before anything starts.
func (c *TLSConfig) Check() error {
	_, err := loadTLS(c)
	return err
}

// loadTLS reads the certificate, key and client CAs of c. Errors name the
// file.
func loadTLS(c *TLSConfig) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("mqtt tls: cert_file %s, key_file %s: %w", c.CertFile, c.KeyFile, err)
	}
	conf := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: c.MinVersion}
	if conf.MinVersion == 0 {
		conf.MinVersion = tls.VersionTLS12
	}
	if c.CAFile != "" {
		pem, err := os.ReadFile(c.CAFile)
		if err != nil {
			return nil, fmt.Errorf("mqtt tls: ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("mqtt tls: ca_file %s: no PEM certificate in it", c.CAFile)
		}
		conf.ClientCAs = pool
		conf.ClientAuth = tls.VerifyClientCertIfGiven
	}
	if c.RequireClientCert {
		if conf.ClientCAs == nil {
			return nil, errors.New("mqtt tls: require_client_cert needs ca_file")
		}
		conf.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return conf, nil
}

// truncate shortens a topic for a log line: a hostile one may be 64 KiB.
func truncate(s string) string {
	if len(s) > 128 {
		return s[:128] + "…"
	}
	return s
}
