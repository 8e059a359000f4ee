package cluster

import (
	"crypto/sha256"
	"testing"

	"github.com/tandem-edge/tandem/replication"
)

func identity(t *testing.T) *replication.Identity {
	t.Helper()
	id, err := replication.LoadOrCreateIdentity(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func memberOf(id *replication.Identity) replication.Member {
	return replication.Member{ID: id.ID, Name: "gw-2", Fingerprint: id.Fingerprint}
}

// The master admits a re-syncing member only on a signature by the old
// member's key over the new identity and the cluster: a proof made for
// another identity, another cluster, or signed by another key is refused.
func TestResyncProofBindsOldKeyNewIdentityAndCluster(t *testing.T) {
	old, fresh, other := identity(t), identity(t), identity(t)
	p, err := signResync(old, "c1", memberOf(fresh))
	if err != nil {
		t.Fatal(err)
	}
	fp, err := p.verify("c1", memberOf(fresh))
	if err != nil || fp != old.Fingerprint || fp != sha256.Sum256(old.Cert.Certificate[0]) {
		t.Fatalf("verify of a good proof: %v (fingerprint %x, old %x)", err, fp, old.Fingerprint)
	}
	if _, err := p.verify("c1", memberOf(other)); err == nil {
		t.Error("a proof made for one new identity admitted another")
	}
	if _, err := p.verify("c2", memberOf(fresh)); err == nil {
		t.Error("a proof made for one cluster admitted in another")
	}
	forged, err := signResync(other, "c1", memberOf(fresh))
	if err != nil {
		t.Fatal(err)
	}
	forged.OldCert = old.Cert.Certificate[0] // old's certificate, other's signature
	if _, err := forged.verify("c1", memberOf(fresh)); err == nil {
		t.Error("a signature by another key passed as the old member's")
	}
}

// MembersFile is written only when the membership changes, and read back
// as written.
func TestMembersFileRoundTrip(t *testing.T) {
	dir := t.TempDir()
	a, b := identity(t), identity(t)
	ms := []replication.Member{{ID: a.ID, Name: "gw-1", Addrs: []string{"198.51.100.1:7883"}, Fingerprint: a.Fingerprint, Voter: true}, memberOf(b)}
	var w membersWriter
	if err := w.write(dir, "c1", b.ID, ms); err != nil {
		t.Fatal(err)
	}
	k, err := ReadMembersFile(dir)
	if err != nil {
		t.Fatal(err)
	}
	if k.Cluster != "c1" || k.Self != replication.IDString(b.ID) || len(k.Others()) != 1 || !sameDetails(k.Others()[0], ms[0]) || !k.Others()[0].Voter {
		t.Errorf("read back %+v", k)
	}
}
