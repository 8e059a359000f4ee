package uplink

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// writeCert writes a certificate for name (and its key) signed by parent
// (self-signed when nil) into dir as name.pem and name.key.
func writeCert(t *testing.T, dir, name string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, tmpl *x509.Certificate) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl.Subject = pkix.Name{CommonName: name}
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(time.Hour)
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	write := func(file, typ string, b []byte) {
		if err := os.WriteFile(filepath.Join(dir, file), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(name+".pem", "CERTIFICATE", der)
	write(name+".key", "EC PRIVATE KEY", kder)
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// A cloud as the public ones are: TLS with the gateway's client
// certificate and a user name and password.
func TestTLSWithClientCertificateAndPassword(t *testing.T) {
	dir := t.TempDir()
	ca, caKey := writeCert(t, dir, "ca", nil, nil, &x509.Certificate{
		SerialNumber: big.NewInt(1), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign,
	})
	writeCert(t, dir, "server", ca, caKey, &x509.Certificate{
		SerialNumber: big.NewInt(2), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	writeCert(t, dir, "client", ca, caKey, &x509.Certificate{
		SerialNumber: big.NewInt(3), ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	writeCert(t, dir, "stranger", nil, nil, &x509.Certificate{
		SerialNumber: big.NewInt(4), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	})
	pw := filepath.Join(dir, "passwd")
	if out, err := exec.Command("mosquitto_passwd", "-b", "-c", pw, "gw7", "s3cret").CombinedOutput(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("mosquitto_passwd: %v %s", err, out)
		}
		t.Skipf("mosquitto_passwd: %v %s", err, out)
	}
	tlsPort := testutil.FreePort(t)
	c := startCloudWith(t, func(string) string {
		return fmt.Sprintf("listener %d 127.0.0.1\nallow_anonymous false\npassword_file %s\n"+
			"cafile %s\ncertfile %s\nkeyfile %s\nrequire_certificate true\n",
			tlsPort, pw, filepath.Join(dir, "ca.pem"), filepath.Join(dir, "server.pem"), filepath.Join(dir, "server.key"))
	})
	rec := newRecorder(t, c, "#")
	goodPw := filepath.Join(dir, "gw7.pw")
	badPw := filepath.Join(dir, "wrong.pw")
	if err := os.WriteFile(goodPw, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(badPw, []byte("guess\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfgWith := func(name, caFile, pwFile string) Config {
		cfg := testConfig(c)
		cfg.Name = name
		cfg.Broker = fmt.Sprintf("tls://127.0.0.1:%d", tlsPort)
		cfg.TLS = TLSFiles{CAFile: caFile, CertFile: filepath.Join(dir, "client.pem"), KeyFile: filepath.Join(dir, "client.key")}
		cfg.Username, cfg.PasswordFile = "gw7", pwFile
		return cfg
	}

	t.Run("good", func(t *testing.T) {
		l := newMemLog()
		u := runUplink(t, cfgWith("good", filepath.Join(dir, "ca.pem"), goodPw), l, &sink{}, nil, 0)
		for i := 1; i <= 5; i++ {
			l.add("p", "dev/a", fmt.Sprintf("p/%d", i))
		}
		testutil.WaitFor(t, 10*time.Second, "5 messages over TLS", func() bool { return rec.distinct() == 5 })
		checkPerPublisher(t, rec.all(), map[string]int{"p": 5})
		if st := u.Status(); !st.Connected {
			t.Errorf("status %+v", st)
		}
	})
	for _, bad := range []struct{ name, ca, pw, want string }{
		{"wrong-password", filepath.Join(dir, "ca.pem"), badPw, "CONNACK reason 0x"},
		{"untrusted-server", filepath.Join(dir, "stranger.pem"), goodPw, "certificate"},
	} {
		t.Run(bad.name, func(t *testing.T) {
			l := newMemLog()
			l.add("p", "dev/a", "never")
			u := runUplink(t, cfgWith(bad.name, bad.ca, bad.pw), l, &sink{}, nil, 0)
			testutil.WaitFor(t, 5*time.Second, "the refusal in status", func() bool {
				return strings.Contains(u.Status().LastError, bad.want)
			}, func() string { return fmt.Sprintf("status %+v", u.Status()) })
			if st := u.Status(); st.Connected || st.BacklogRecords != 1 || u.Counters().Forwarded != 0 {
				t.Errorf("status %+v, counters %+v", st, u.Counters())
			}
		})
	}
	if _, err := New(cfgWith("x", filepath.Join(dir, "missing.pem"), goodPw), Deps{Log: newMemLog(), Positions: &sink{}, Filters: filters}); err == nil || !strings.Contains(err.Error(), "ca_file") {
		t.Errorf("a missing ca_file: %v", err)
	}
}
