package mqtt

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// selfSigned writes a certificate and key for 127.0.0.1 into dir.
func selfSigned(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "gw"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem")
	os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	return certFile, keyFile
}

// The TLS listener offers TLS 1.2 with forward-secret AEAD suites only: a
// client that can only do CBC is refused in the handshake; one with GCM
// gets in.
func TestTLS12OnlyAEADSuites(t *testing.T) {
	cert, key := selfSigned(t, t.TempDir())
	s, _ := testServer(t, nil, func(c *Config) { c.TLS = &TLSConfig{Listen: "127.0.0.1:0", CertFile: cert, KeyFile: key} })
	dial := func(suite uint16) error {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", s.TLSAddr(),
			&tls.Config{InsecureSkipVerify: true, MaxVersion: tls.VersionTLS12, CipherSuites: []uint16{suite}})
		if err == nil {
			c.Close()
		}
		return err
	}
	if err := dial(tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA); err == nil {
		t.Fatal("a CBC-SHA1 suite was accepted")
	}
	if err := dial(tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256); err != nil {
		t.Fatalf("an AEAD suite was refused: %v", err)
	}
}
