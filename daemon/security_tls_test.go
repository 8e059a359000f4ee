package daemon

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// ---------------------------------------------------------------------------
// TLS.

// testPKI is a CA, a server certificate for 127.0.0.1 and client
// certificates: good, expired, and one from a CA the gateway does not trust.
type testPKI struct {
	caFile, certFile, keyFile string
	ca                        *x509.CertPool
	good, expired, untrusted  tls.Certificate
}

func newTestPKI(t *testing.T, dir string) *testPKI {
	t.Helper()
	caCert, caKey := newCA(t, "tandem test CA")
	otherCA, otherKey := newCA(t, "someone else's CA")
	now := time.Now()
	p := &testPKI{ca: x509.NewCertPool()}
	p.ca.AddCert(caCert)
	p.caFile = writeFile(t, filepath.Join(dir, "ca.pem"), string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caCert.Raw})))
	server := leaf(t, "gateway", caCert, caKey, now.Add(-time.Hour), now.Add(time.Hour), true)
	p.certFile = writeFile(t, filepath.Join(dir, "server.pem"), string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: server.Certificate[0]})))
	kb, err := x509.MarshalECPrivateKey(server.PrivateKey.(*ecdsa.PrivateKey))
	if err != nil {
		t.Fatal(err)
	}
	p.keyFile = writeFile(t, filepath.Join(dir, "server.key"), string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})))
	p.good = leaf(t, "sensor-1", caCert, caKey, now.Add(-time.Hour), now.Add(time.Hour), false)
	p.expired = leaf(t, "sensor-1", caCert, caKey, now.Add(-48*time.Hour), now.Add(-24*time.Hour), false)
	p.untrusted = leaf(t, "sensor-1", otherCA, otherKey, now.Add(-time.Hour), now.Add(time.Hour), false)
	return p
}

func newCA(t *testing.T, name string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-72 * time.Hour), NotAfter: time.Now().Add(72 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c, key
}

func leaf(t *testing.T, cn string, ca *x509.Certificate, caKey *ecdsa.PrivateKey, from, until time.Time, server bool) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: from, NotAfter: until, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// dialTLS opens a TLS connection with the client certificate given (none
// when cert is nil). The handshake error, if any, is returned: with TLS 1.3
// a refused client certificate may only show on the first read.
func dialTLS(t *testing.T, addr string, ca *x509.CertPool, cert *tls.Certificate) (*tls.Conn, error) {
	t.Helper()
	conf := &tls.Config{RootCAs: ca, ServerName: "127.0.0.1"}
	if cert != nil {
		conf.Certificates = []tls.Certificate{*cert}
	}
	d := &net.Dialer{Timeout: 5 * time.Second}
	conn, err := tls.DialWithDialer(d, "tcp", addr, conf)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { conn.Close() })
	return conn, nil
}

func TestTLSClientCertificates(t *testing.T) {
	dir := t.TempDir()
	pki := newTestPKI(t, dir)
	acl := writeFile(t, filepath.Join(dir, "acl"), "topic readwrite ok/#\nuser sensor-1\ntopic readwrite sensors/sensor-1/#\n")
	d, logs := startGateway(t, func(c *config.Config) {
		c.MQTT.TLS = config.TLSConfig{Listen: "127.0.0.1:0", CertFile: pki.certFile, KeyFile: pki.keyFile, CAFile: pki.caFile,
			RequireClientCert: true, UseIdentityAsUsername: true}
		c.MQTT.ACLFile = acl
	})
	addr := d.MQTTTLSAddr()
	if addr == "" {
		t.Fatal("no TLS listener")
	}

	t.Run("valid certificate, its common name is the user", func(t *testing.T) {
		conn, err := dialTLS(t, addr, pki.ca, &pki.good)
		if err != nil {
			t.Fatal(err)
		}
		if v := conn.ConnectionState().Version; v < tls.VersionTLS12 {
			t.Fatalf("TLS version %#x", v)
		}
		c, ca := mqttOn(t, conn, connOpts{version: 5, id: "cert-client"})
		if ca.closed || ca.code != 0 {
			t.Fatalf("CONNACK %+v", ca)
		}
		c.pub("sensors/sensor-1/t", 1, false, 1, nil, "21.5")
		if r := c.ack(0x40, 1); r != 0 {
			t.Fatalf("own topic: PUBACK %#x", r)
		}
		c.pub("sensors/sensor-2/t", 1, false, 2, nil, "spoof")
		if r := c.ack(0x40, 2); r != 0x87 {
			t.Fatalf("another sensor's topic: PUBACK %#x, want 0x87", r)
		}
	})
	for _, tt := range []struct {
		name string
		cert *tls.Certificate
	}{{"expired certificate", &pki.expired}, {"untrusted certificate", &pki.untrusted}, {"no certificate", nil}} {
		t.Run(tt.name, func(t *testing.T) {
			conn, err := dialTLS(t, addr, pki.ca, tt.cert)
			if err == nil {
				// TLS 1.3: the server's verdict comes with the first read.
				conn.SetDeadline(time.Now().Add(5 * time.Second))
				conn.Write([]byte{0x10, byte(len(connectBody(connOpts{version: 4, id: "bad"})))})
				conn.Write(connectBody(connOpts{version: 4, id: "bad", keepAlive: 60}))
				var b [1]byte
				_, err = conn.Read(b[:])
			}
			if err == nil {
				t.Fatal("the gateway answered a client with a bad certificate")
			}
			if !strings.Contains(err.Error(), "tls") && !strings.Contains(err.Error(), "reset") && err != io.EOF {
				t.Fatalf("unexpected error: %v", err)
			}
		})
	}
	testutil.WaitFor(t, 5*time.Second, "the handshake failures to be logged", func() bool { return logs.Count("TLS handshake failed") >= 1 })
	if n := logs.Count("TLS handshake failed"); n != 1 {
		t.Errorf("3 failed handshakes from one address logged %d times, want once a minute", n)
	}
	// The plain listener (loopback, anonymous) and the log are unharmed.
	recs := assertServing(t, d, "", "")
	noRecordFrom(t, recs, "bad")
	if n := countTopic(t, d, "sensors/sensor-1/t"); n != 1 {
		t.Fatalf("the certificate client's publish is in the log %d times", n)
	}
}
