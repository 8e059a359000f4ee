package cluster

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/replication"
)

// A damaged member heals from its peers (storage.on_damage: resync). A
// member whose data file fails its checks at start has lost its raft hard
// state (term, vote) with it: coming back under the same id with an empty
// log could make it vote twice in one term. So it comes back under a fresh
// id (a new key pair; the node id derives from the key), and proves to the
// master that it is the damaged member by signing the new identity with
// the old key, which lives beside the data file, not in it. The master
// removes the old id and adds the new one as a learner; the keeper promotes
// it as it promotes any joiner once it has caught up.
//
// The member learns where its cluster is from MembersFile, which every
// member keeps beside the data file: the data file itself may be what is
// unreadable.

// MembersFile is the name, in the data dir, of the copy of the membership
// kept outside the data file.
const MembersFile = "members.json"

// KnownCluster is MembersFile's content: the cluster this node was last a
// member of, as it applied it.
type KnownCluster struct {
	Cluster string               `json:"cluster"`
	Self    string               `json:"self"` // this node's id, 16 hex digits
	Members []replication.Member `json:"members"`
}

// Others returns the members other than this node.
func (k KnownCluster) Others() []replication.Member {
	var out []replication.Member
	for _, m := range k.Members {
		if replication.IDString(m.ID) != k.Self {
			out = append(out, m)
		}
	}
	return out
}

// ReadMembersFile reads MembersFile in dir.
func ReadMembersFile(dir string) (KnownCluster, error) {
	var k KnownCluster
	b, err := os.ReadFile(filepath.Join(dir, MembersFile))
	if err != nil {
		return k, err
	}
	if err := json.Unmarshal(b, &k); err != nil {
		return k, fmt.Errorf("%s: %w", filepath.Join(dir, MembersFile), err)
	}
	return k, nil
}

// membersWriter keeps MembersFile current, writing it only when it would
// change: the keeper offers it the membership every tick.
type membersWriter struct {
	mu   sync.Mutex // guards last and the file
	last []byte
}

// write records members of cluster for the node self in dir: a temporary
// file, fsynced, renamed over the old one.
func (w *membersWriter) write(dir, cluster string, self uint64, members []replication.Member) error {
	b, err := json.MarshalIndent(KnownCluster{Cluster: cluster, Self: replication.IDString(self), Members: members}, "", "  ")
	if err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if string(b) == string(w.last) {
		return nil
	}
	if err := replication.WriteFileAtomic(filepath.Join(dir, MembersFile), append(b, '\n'), 0o640); err != nil {
		return err
	}
	w.last = b
	return nil
}

// recordMembers writes MembersFile for the membership this node applies.
func (c *cluster) recordMembers(members []replication.Member) {
	d := c.d
	if err := c.members.write(d.cfg.Node.DataDir, c.clusterID(), d.id.ID, members); err != nil {
		d.log.Warn("writing the copy of the membership beside the data file failed; a damaged data file could then not re-sync by itself", "file", MembersFile, "error", err)
	}
}

// ResyncProof is a damaged member's proof that it is the member it was:
// its old certificate and, by the old key, a signature over the new
// identity it rejoins with.
type ResyncProof struct {
	OldCert []byte `json:"old_cert"` // DER
	Sig     []byte `json:"sig"`
}

// resyncDigest is what the old key signs: the cluster and the new member.
func resyncDigest(cluster string, m replication.Member) []byte {
	h := sha256.Sum256([]byte("tandem-resync\x00" + cluster + "\x00" + replication.IDString(m.ID) + "\x00" + hex.EncodeToString(m.Fingerprint[:])))
	return h[:]
}

// signResync makes the proof for self, signed by old.
func signResync(old *replication.Identity, cluster string, self replication.Member) (*ResyncProof, error) {
	signer, ok := old.Cert.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, errors.New("the old key cannot sign")
	}
	sig, err := signer.Sign(rand.Reader, resyncDigest(cluster, self), crypto.SHA256)
	if err != nil {
		return nil, err
	}
	return &ResyncProof{OldCert: old.Cert.Certificate[0], Sig: sig}, nil
}

// verify checks the proof for the new member m of cluster and returns the
// old certificate's fingerprint.
func (p *ResyncProof) verify(cluster string, m replication.Member) ([32]byte, error) {
	fp := sha256.Sum256(p.OldCert)
	cert, err := x509.ParseCertificate(p.OldCert)
	if err != nil {
		return fp, fmt.Errorf("the old certificate: %w", err)
	}
	digest := resyncDigest(cluster, m)
	ok := false
	switch pub := cert.PublicKey.(type) {
	case *ecdsa.PublicKey:
		ok = ecdsa.VerifyASN1(pub, digest, p.Sig)
	case ed25519.PublicKey:
		ok = ed25519.Verify(pub, digest, p.Sig)
	}
	if !ok {
		return fp, errors.New("the signature by the old key does not check out")
	}
	return fp, nil
}

// resyncBook remembers, on the master, which old member each new id
// replaced, so that a damaged member whose answer was lost after its old id
// was removed is admitted again.
type resyncBook struct {
	mu       sync.Mutex // guards replaced
	replaced map[[32]byte]uint64
}

func (b *resyncBook) set(fp [32]byte, id uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.replaced == nil {
		b.replaced = map[[32]byte]uint64{}
	}
	b.replaced[fp] = id
}

func (b *resyncBook) get(fp [32]byte) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.replaced[fp]
}

// admitResync answers a damaged member's knock on the master: the old
// member (a current one, or the master this node was promoted over) goes,
// the new identity comes in as a learner.
func (c *cluster) admitResync(ctx context.Context, r replication.Remote, req JoinRequest) (JoinReply, error) {
	d := c.d
	m := req.Member
	if m.ID != r.ID || m.Fingerprint != r.Fingerprint {
		return JoinReply{}, errors.New("the re-syncing node's details do not match its certificate")
	}
	n := d.node()
	if n.Leader() != n.ID() {
		return JoinReply{}, errors.New("this gateway is not the master")
	}
	oldFP, err := req.Resync.verify(c.clusterID(), m)
	if err != nil {
		return JoinReply{}, err
	}
	var old *replication.Member
	already := false
	for _, x := range n.Members() {
		if x.Fingerprint == oldFP {
			old = &x
		}
		already = already || x.ID == m.ID
	}
	dep, fork, deposed, _ := c.deposedRecord()
	deposed = deposed && dep.Fingerprint == oldFP
	switch {
	case old != nil && old.ID == m.ID:
		return JoinReply{}, errors.New("a re-syncing member must come back under a fresh id")
	case old != nil && old.ID == n.ID():
		return JoinReply{}, errors.New("that is this gateway's own old identity")
	case old != nil:
		if err := n.ChangeMember(ctx, raftpb.ConfChangeRemoveNode, replication.Member{ID: old.ID}); err != nil {
			return JoinReply{}, fmt.Errorf("removing the damaged member's old id: %w", err)
		}
		c.resynced.set(oldFP, m.ID)
		d.log.Warn("a member's data was damaged: its old id is removed, it rejoins under a fresh one and re-syncs the log", "peer", old.Name, "old_id", replication.IDString(old.ID), "new_id", replication.IDString(m.ID))
	case deposed:
		if err := d.db.PutMeta(metaDeposed, nil); err != nil {
			return JoinReply{}, err
		}
		c.resynced.set(oldFP, m.ID)
		d.log.Warn("the master this gateway was promoted over lost its data: it rejoins under a fresh id and re-syncs the log", "peer", dep.Name, "old_id", replication.IDString(dep.ID), "new_id", replication.IDString(m.ID))
	case already || c.resynced.get(oldFP) == m.ID:
		// An earlier answer was lost: answer as then.
	default:
		return JoinReply{}, errors.New("the old certificate is not a member's of this cluster")
	}
	rep, err := c.addMember(ctx, m, func() {})
	if deposed {
		rep.Fork = fork
	}
	return rep, err
}

// Resynced is what a re-sync ended with: the master's answer.
type Resynced struct {
	Master string
	// MasterLast is the master's last log index when it admitted this
	// node: what this node held past it, only it held.
	MasterLast uint64
	// Fork is set when this node was a master promoted over: what it
	// held past the fork, only it held.
	Fork uint64
}

// Resync rejoins the cluster known (read from MembersFile before the damaged
// files were moved aside) under this gateway's fresh identity, proven by the
// old one: it knocks on the other members until the master admits it, then
// replays the master's log as a joiner does; done is called once it is a
// member. It runs in the background until then or until Stop.
func (d *Gateway) Resync(old *replication.Identity, known KnownCluster, done func(Resynced)) {
	c := d.cl
	c.goFunc(func() {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		c.goFunc(func() { // ends the knocks at Stop
			select {
			case <-c.stopc:
				cancel()
			case <-ctx.Done():
			}
		})
		wait := 500 * time.Millisecond
		var lastErr string
		seen := map[uint64][]string{} // where mDNS shows the known members now
		for {
			rep, err := c.resyncRound(ctx, old, known, seen)
			if err == nil {
				if _, err = c.becomeMember(ctx, rep, JoinFresh, 0); err == nil {
					done(Resynced{Master: rep.Master, MasterLast: rep.Last, Fork: rep.Fork})
					return
				}
			}
			if ctx.Err() != nil {
				return
			}
			if err.Error() != lastErr {
				d.log.Warn("re-syncing from the cluster: no master admitted this gateway yet; will retry", "error", err)
				lastErr = err.Error()
			}
			if d.cfg.Discovery.MDNS {
				c.resyncBrowse(ctx, known, seen)
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
			wait = min(2*wait, 5*time.Second)
		}
	})
}

// resyncBrowse adds to seen the addresses mDNS shows for the other known
// members, by id and cluster: a member that moved since MembersFile was
// written (a new DHCP lease while this gateway was down) is knocked at
// there. mDNS is not authenticated, but the knock checks the member's
// pinned fingerprint, so an impostor announcing its id gains nothing.
func (c *cluster) resyncBrowse(ctx context.Context, known KnownCluster, seen map[uint64][]string) {
	peers, ok := c.browsePeers(ctx)
	if !ok {
		return
	}
	for _, m := range known.Others() {
		for _, p := range peers {
			if p.ID == replication.IDString(m.ID) && p.Cluster == known.Cluster && len(p.Addrs) > 0 && !slices.Equal(p.Addrs, seen[m.ID]) {
				c.d.log.Info("member found at a new address", "peer", m.Name, "addrs", p.Addrs, "was", m.Addrs)
				seen[m.ID] = slices.Clone(p.Addrs)
			}
		}
	}
}

// resyncRound knocks once on every address of every other known member,
// those mDNS showed (seen) first, and returns the first master's answer.
func (c *cluster) resyncRound(ctx context.Context, old *replication.Identity, known KnownCluster, seen map[uint64][]string) (JoinReply, error) {
	self := c.d.self()
	proof, err := signResync(old, known.Cluster, self)
	if err != nil {
		return JoinReply{}, err
	}
	payload, _ := json.Marshal(JoinRequest{Member: self, Resync: proof})
	var errs []error
	for _, m := range known.Others() {
		addrs := slices.Clone(seen[m.ID])
		for _, a := range c.peerAddrs(m) {
			if !slices.Contains(addrs, a) {
				addrs = append(addrs, a)
			}
		}
		for _, addr := range addrs {
			kctx, cancel := context.WithTimeout(ctx, knockTimeout(c.rtt.patience(), 0))
			reply, remote, err := c.tr.Knock(kctx, addr, m.Fingerprint, replication.KnockJoin, payload)
			cancel()
			if err != nil {
				errs = append(errs, fmt.Errorf("%s at %s: %w", m.Name, addr, unwrapRemote(err)))
				if errors.Is(err, replication.ErrRemote) {
					break // it answered: not the master
				}
				continue
			}
			var rep JoinReply
			if err := json.Unmarshal(reply, &rep); err != nil || remote.ID != m.ID {
				errs = append(errs, fmt.Errorf("%s at %s: a malformed answer", m.Name, addr))
				continue
			}
			if rep.Cluster != known.Cluster {
				errs = append(errs, fmt.Errorf("%s answered for cluster %s, this gateway was in %s", m.Name, rep.Cluster, known.Cluster))
				continue
			}
			return rep, nil
		}
	}
	if len(errs) == 0 {
		return JoinReply{}, errors.New("no other member known")
	}
	return JoinReply{}, errors.Join(errs...)
}
