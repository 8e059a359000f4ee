package replication

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"time"
)

// Identity is a node's key pair, self-signed certificate and the ids derived
// from them. It is made once, at first start, and kept in the data dir: the
// node id never changes, whatever the node's addresses do.
type Identity struct {
	ID          uint64   // first 8 bytes of SHA-256(public key), never 0
	Fingerprint [32]byte // SHA-256 of the certificate (DER), pinned by peers
	Cert        tls.Certificate
}

// Identity file names inside the data dir.
const (
	KeyFile  = "node.key"
	CertFile = "node.crt"
)

// IDString formats a node id as DESIGN.md says: 16 hex digits.
func IDString(id uint64) string { return fmt.Sprintf("%016x", id) }

// ShortID is the first 8 hex digits of a node id, for humans.
func ShortID(id uint64) string { return IDString(id)[:8] }

// LoadOrCreateIdentity reads the identity in dir, creating it if neither
// file exists. One file without the other is an error, never overwritten.
func LoadOrCreateIdentity(dir string) (*Identity, error) {
	kp, cp := filepath.Join(dir, KeyFile), filepath.Join(dir, CertFile)
	_, kerr := os.Stat(kp)
	_, cerr := os.Stat(cp)
	switch {
	case errors.Is(kerr, os.ErrNotExist):
		// The key is written last, so no key means no identity was ever
		// complete here (a lone certificate is useless without it). The
		// data file's recorded node id catches a key deleted later.
		if err := createIdentity(dir, kp, cp); err != nil {
			return nil, err
		}
	case kerr != nil && !errors.Is(kerr, os.ErrNotExist):
		// Not a missing file (permission denied, I/O): say that, not
		// "restore the missing one".
		return nil, fmt.Errorf("identity: %w", kerr)
	case cerr != nil && !errors.Is(cerr, os.ErrNotExist):
		return nil, fmt.Errorf("identity: %w", cerr)
	case kerr != nil || cerr != nil:
		return nil, fmt.Errorf("identity: %s and %s must both exist (%v, %v); restore the missing one: the node id derives from the key", kp, cp, kerr, cerr)
	}
	cert, err := tls.LoadX509KeyPair(cp, kp)
	if err != nil {
		return nil, fmt.Errorf("identity: %w", err)
	}
	leaf, err := x509.ParseCertificate(cert.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("identity: %w", err)
	}
	cert.Leaf = leaf
	return &Identity{ID: NodeIDFromPublicKey(leaf.RawSubjectPublicKeyInfo), Fingerprint: sha256.Sum256(leaf.Raw), Cert: cert}, nil
}

// NodeIDFromPublicKey derives a node id from a DER SubjectPublicKeyInfo.
func NodeIDFromPublicKey(spki []byte) uint64 {
	h := sha256.Sum256(spki)
	id := binary.BigEndian.Uint64(h[:8])
	if id == 0 { // raft reserves 0 for "none"
		id = 1
	}
	return id
}

func createIdentity(dir, kp, cp string) error {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	spki, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	id := NodeIDFromPublicKey(spki)
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "tandem node " + IDString(id)},
		DNSNames:              []string{"tandem-" + IDString(id)},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(100, 0, 0), // pinned by fingerprint, not by expiry
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	// Certificate first, key last: the key's presence marks a complete pair.
	if err := writeFileAtomic(cp, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return err
	}
	return writeFileAtomic(kp, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600)
}

// writeFileAtomic is WriteFileAtomic for the identity's files.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	if err := WriteFileAtomic(path, data, perm); err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	return nil
}

// WriteFileAtomic writes via a synced temp file and a rename, so a crash
// leaves either no file or the whole one (the old one, if any, until the
// rename), and syncs the directory.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	if _, err = f.Write(data); err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	if d, err := os.Open(filepath.Dir(path)); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}
