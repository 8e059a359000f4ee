package mqtt

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
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

// aeadSuites are the TLS 1.2 suites the listener offers: forward-secret
// AEAD only, no CBC or SHA-1 (TLS 1.3 has only such suites, and Go does not
// let them be chosen). Devices too old for these can use min_version "1.2"
// with nothing weaker, and should be upgraded rather than served CBC.
var aeadSuites = []uint16{
	tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256, tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
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
	conf := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: c.MinVersion, CipherSuites: aeadSuites}
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
