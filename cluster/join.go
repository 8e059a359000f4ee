package cluster

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/replication"
)

// TokenPrefix starts every join token, so a token pasted into the wrong
// place (or a pairing code into `cluster join`) is recognised as such.
const TokenPrefix = "tandem1."

// DefaultInviteTTL is how long a join token stays valid.
const DefaultInviteTTL = time.Hour

// joinToken is what `tandem cluster invite` prints: where the master is,
// which certificate it must present, a one-time secret and an expiry.
type joinToken struct {
	Cluster string   `json:"c"`
	Addrs   []string `json:"a"`
	FP      string   `json:"f"`
	Secret  []byte   `json:"s"`
	Expires int64    `json:"e"` // Unix seconds
}

// Encode gives the token's one-line text form.
func (t joinToken) Encode() string {
	b, _ := json.Marshal(t)
	return TokenPrefix + base64.RawURLEncoding.EncodeToString(b)
}

// ParseToken reads a token's text form and checks its shape and expiry.
func ParseToken(s string, now time.Time) (joinToken, [32]byte, error) {
	var t joinToken
	var fp [32]byte
	s = strings.TrimSpace(s)
	if !strings.HasPrefix(s, TokenPrefix) {
		return t, fp, errors.New("invalid join token: it does not start with " + TokenPrefix + " (copy the whole line `tandem cluster invite` printed)")
	}
	b, err := base64.RawURLEncoding.DecodeString(s[len(TokenPrefix):])
	if err == nil {
		err = json.Unmarshal(b, &t)
	}
	if err != nil {
		return t, fp, fmt.Errorf("invalid join token: %v (was it cut short?)", err)
	}
	f, err := hex.DecodeString(t.FP)
	if err != nil || len(f) != 32 || len(t.Secret) < 16 || len(t.Addrs) == 0 || t.Cluster == "" {
		return t, fp, errors.New("invalid join token: fields missing or malformed")
	}
	copy(fp[:], f)
	if exp := time.Unix(t.Expires, 0); now.After(exp) {
		return t, fp, fmt.Errorf("join token expired at %s: ask the master for a new one (tandem cluster invite)", exp.UTC().Format(time.RFC3339))
	}
	return t, fp, nil
}

// invite is one outstanding join token, known by its secret's hash.
type invite struct {
	hash    [32]byte
	expires time.Time
	usedBy  uint64 // the node that joined with it, 0 while unused
}

// inviteBook holds the master's outstanding invites, in memory only: a
// restart of the master invalidates them, which errs on the safe side.
type inviteBook struct {
	mu   sync.Mutex
	list []*invite

	pair pairBook // the open pairing code, if any (pair.go)
}

// add records a new invite for secret.
func (b *inviteBook) add(secret []byte, expires time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	kept := b.list[:0]
	for _, in := range b.list {
		if now.Before(in.expires) {
			kept = append(kept, in)
		}
	}
	b.list = append(kept, &invite{hash: sha256.Sum256(secret), expires: expires})
}

// claim marks the invite of secret used by node, or says why it cannot be.
// The same node may claim its own invite again: a joiner whose first answer
// was lost retries with the same token.
func (b *inviteBook) claim(secret []byte, node uint64, now time.Time) (*invite, error) {
	h := sha256.Sum256(secret)
	b.mu.Lock()
	defer b.mu.Unlock()
	var found *invite
	for _, in := range b.list {
		if subtle.ConstantTimeCompare(in.hash[:], h[:]) == 1 {
			found = in
		}
	}
	switch {
	case found == nil:
		return nil, errors.New("join token not valid here: unknown secret (tokens are void after the master restarts)")
	case found.usedBy != 0 && found.usedBy != node:
		return nil, errors.New("join token already used: each token admits one gateway")
	case found.usedBy == 0 && now.After(found.expires):
		return nil, errors.New("join token expired")
	}
	found.usedBy = node
	return found, nil
}

// release makes a claimed invite usable again after the join failed.
func (b *inviteBook) release(in *invite) {
	b.mu.Lock()
	in.usedBy = 0
	b.mu.Unlock()
}

// JoinRequest is the knock a joining node makes on the master's peer port.
type JoinRequest struct {
	Secret []byte             `json:"secret"`
	Member replication.Member `json:"member"`
	// Rejoin asks, instead, whether the knocked node promoted itself over
	// this one (a master deposed by `tandem promote`): Gen is the
	// knocker's generation.
	Rejoin bool   `json:"rejoin,omitempty"`
	Gen    uint64 `json:"gen,omitempty"`
	// Probe only asks whether the knocked node is alive: a slave with
	// failover: auto asks its silent master before promoting itself.
	Probe bool `json:"probe,omitempty"`
	// Resync, instead, is a damaged member rejoining under a fresh
	// identity (Member), proven by its old one (resync.go).
	Resync *ResyncProof `json:"resync,omitempty"`
}

// JoinReply is the master's answer: the cluster the joiner now belongs to.
type JoinReply struct {
	Cluster    string               `json:"cluster"`
	Generation uint64               `json:"gen"`
	Members    []replication.Member `json:"members"`
	Commit     uint64               `json:"commit"`
	Master     string               `json:"master"`
	// Last is the master's last log index when it answered.
	Last uint64 `json:"last,omitempty"`
	// Fork is, for a rejoining deposed master, the promoted node's last
	// index before its promotion, and ForkTerm the term of its entry there.
	Fork     uint64 `json:"fork,omitempty"`
	ForkTerm uint64 `json:"fork_term,omitempty"`
}

// adminRequest is a cluster command a slave passes to the master.
type adminRequest struct {
	Op    string        `json:"op"` // "invite", "remove" or "pair"
	TTL   time.Duration `json:"ttl,omitempty"`
	Node  string        `json:"node,omitempty"`
	Force bool          `json:"force,omitempty"`
}

// adminReply answers an adminRequest.
type adminReply struct {
	Token   string    `json:"token,omitempty"`
	Removed string    `json:"removed,omitempty"`
	Code    string    `json:"code,omitempty"`   // "pair": the pairing code
	Expires time.Time `json:"expires,omitzero"` // "pair": when it expires
}

// ErrNoMaster is the answer to a cluster command while no master is known.
var ErrNoMaster = errors.New("no master known right now: try again once the cluster has elected one (tandem status)")

// admin runs a cluster command on the master: here if this node is the
// master, else by asking it over the peer link.
func (c *cluster) admin(ctx context.Context, req adminRequest) (adminReply, error) {
	n := c.d.node()
	lead := n.Leader()
	switch lead {
	case 0:
		return adminReply{}, ErrNoMaster
	case n.ID():
		return c.adminLocal(ctx, req)
	}
	b, _ := json.Marshal(req)
	out, err := c.tr.Request(ctx, lead, reqAdmin, b)
	if err != nil {
		return adminReply{}, fmt.Errorf("asking the master: %w", unwrapRemote(err))
	}
	var rep adminReply
	err = json.Unmarshal(out, &rep)
	return rep, err
}

// unwrapRemote strips the transport's wrapping off a peer's error text.
func unwrapRemote(err error) error {
	if errors.Is(err, replication.ErrRemote) {
		msg := err.Error()
		if i := strings.Index(msg, replication.ErrRemote.Error()+": "); i >= 0 {
			return errors.New(msg[i+len(replication.ErrRemote.Error())+2:])
		}
	}
	return err
}

// handleAdmin is the master's side of admin.
func (c *cluster) handleAdmin(ctx context.Context, payload []byte) ([]byte, error) {
	var req adminRequest
	if err := json.Unmarshal(payload, &req); err != nil {
		return nil, err
	}
	n := c.d.node()
	if n.Leader() != n.ID() {
		return nil, errors.New("this node is no longer the master; try again")
	}
	rep, err := c.adminLocal(ctx, req)
	if err != nil {
		return nil, err
	}
	return json.Marshal(rep)
}

// adminLocal runs a cluster command on this node, the master.
func (c *cluster) adminLocal(ctx context.Context, req adminRequest) (adminReply, error) {
	switch req.Op {
	case "invite":
		tok, err := c.newInvite(req.TTL)
		return adminReply{Token: tok}, err
	case "remove":
		name, err := c.remove(ctx, req.Node, req.Force)
		return adminReply{Removed: name}, err
	case "pair":
		code, exp, err := c.openPairing(req.TTL)
		return adminReply{Code: code, Expires: exp}, err
	}
	return adminReply{}, fmt.Errorf("unknown cluster command %q", req.Op)
}

// newInvite makes a join token on the master.
func (c *cluster) newInvite(ttl time.Duration) (string, error) {
	if ttl <= 0 {
		ttl = DefaultInviteTTL
	}
	if len(c.d.node().Members()) >= replication.MaxMembers {
		return "", fmt.Errorf("the cluster already has %d gateways, the most tandem runs: remove one first", replication.MaxMembers)
	}
	secret := make([]byte, 16)
	if _, err := rand.Read(secret); err != nil {
		return "", err
	}
	exp := time.Now().Add(ttl)
	c.invites.add(secret, exp)
	self := c.d.self()
	tok := joinToken{Cluster: c.clusterID(), Addrs: self.Addrs, FP: hex.EncodeToString(self.Fingerprint[:]), Secret: secret, Expires: exp.Unix()}
	c.d.log.Info("join token issued", "expires", exp.UTC().Format(time.RFC3339))
	return tok.Encode(), nil
}

// onStranger answers a knock on the peer port: a join token's secret. A
// pairing proof is the pairing issue's; until then it is refused.
func (c *cluster) onStranger(ctx context.Context, r replication.Remote, kind byte, payload []byte) ([]byte, error) {
	if c.d.node() == nil {
		return nil, errors.New("this gateway is still starting")
	}
	if kind == replication.KnockPair {
		return c.onPair(ctx, r, payload)
	}
	if kind != replication.KnockJoin {
		return nil, errors.New("unknown knock")
	}
	var req JoinRequest
	if err := json.Unmarshal(payload, &req); err != nil {
		return nil, errors.New("malformed join request")
	}
	if req.Probe {
		// Anyone may ask: the answer says no more than mDNS advertises.
		n := c.d.node()
		return json.Marshal(probeReply{Cluster: c.clusterID(), Generation: c.generation(), Master: n.Leader() == n.ID()})
	}
	if req.Resync != nil {
		rep, err := c.admitResync(ctx, r, req)
		if err != nil {
			c.d.log.Warn("re-sync of a damaged member refused", "from", r.Addr, "peer", replication.IDString(r.ID), "reason", err)
			return nil, err
		}
		return json.Marshal(rep)
	}
	if req.Rejoin {
		rep, err := c.admitRejoin(ctx, r, req)
		if err != nil {
			return nil, err
		}
		return json.Marshal(rep)
	}
	rep, err := c.admit(ctx, r, req)
	if err != nil {
		c.d.log.Warn("join refused", "from", r.Addr, "peer", replication.IDString(r.ID), "reason", err)
		return nil, err
	}
	return json.Marshal(rep)
}

// admit adds a joining node as a learner once its secret checks out.
func (c *cluster) admit(ctx context.Context, r replication.Remote, req JoinRequest) (JoinReply, error) {
	m := req.Member
	if m.ID != r.ID || m.Fingerprint != r.Fingerprint {
		return JoinReply{}, errors.New("the joining node's details do not match its certificate")
	}
	n := c.d.node()
	if n.Leader() != n.ID() {
		return JoinReply{}, errors.New("this gateway is not the master (the token names the master at the time of the invite): ask the current master for a new token")
	}
	in, err := c.invites.claim(req.Secret, m.ID, time.Now())
	if err != nil {
		return JoinReply{}, err
	}
	return c.addMember(ctx, m, func() { c.invites.release(in) })
}

// addMember adds m, whose right to join was checked (a token's secret or a
// pairing proof), as a learner unless it is a member already, and answers
// with the cluster it joined. release gives the right back when m could
// not be added.
func (c *cluster) addMember(ctx context.Context, m replication.Member, release func()) (JoinReply, error) {
	n := c.d.node()
	already := false
	for _, x := range n.Members() {
		if x.ID == m.ID {
			already = true
		}
	}
	if !already {
		if len(n.Members()) >= replication.MaxMembers {
			release()
			return JoinReply{}, replication.ErrClusterFull
		}
		m.Voter = false
		if err := n.ChangeMember(ctx, raftpb.ConfChangeAddLearnerNode, m); err != nil {
			release()
			return JoinReply{}, fmt.Errorf("adding the node: %w", err)
		}
		c.d.log.Info("gateway joined the cluster", "peer", m.Name, "id", replication.IDString(m.ID), "addrs", m.Addrs)
	}
	st, err := n.Status(ctx)
	if err != nil {
		return JoinReply{}, err
	}
	return JoinReply{Cluster: c.clusterID(), Generation: c.generation(), Members: n.Members(), Commit: st.Commit, Master: c.d.cfg.Node.Name, Last: st.Last}, nil
}

// JoinMode says what a joining node does with the records it holds.
type JoinMode string

// Join modes of `tandem cluster join`.
const (
	JoinFresh   JoinMode = ""
	JoinRequeue JoinMode = "requeue"
	JoinDiscard JoinMode = "discard"
)

// join makes this node a member of the cluster token names.
func (c *cluster) join(ctx context.Context, token string, mode JoinMode) (JoinReply, error) {
	d := c.d
	tok, fp, err := ParseToken(token, time.Now())
	if err != nil {
		return JoinReply{}, config.UsageError{Err: err}
	}
	recs, err := c.joinable(tok.Cluster, mode)
	if err != nil {
		return JoinReply{}, err
	}
	payload, _ := json.Marshal(JoinRequest{Secret: tok.Secret, Member: d.self()})
	var reply []byte
	var errs []error
	for _, addr := range tok.Addrs {
		reply, _, err = c.tr.Knock(ctx, addr, fp, replication.KnockJoin, payload)
		if err == nil {
			break
		}
		if errors.Is(err, replication.ErrRemote) {
			return JoinReply{}, fmt.Errorf("the master refused: %w", unwrapRemote(err))
		}
		errs = append(errs, fmt.Errorf("%s: %w", addr, err))
	}
	if err != nil {
		return JoinReply{}, fmt.Errorf("cannot reach the master: %w", errors.Join(errs...))
	}
	var rep JoinReply
	if err := json.Unmarshal(reply, &rep); err != nil {
		return JoinReply{}, fmt.Errorf("the master's answer: %w", err)
	}
	if rep.Cluster != tok.Cluster {
		return JoinReply{}, fmt.Errorf("the master answered for cluster %s, the token names %s", rep.Cluster, tok.Cluster)
	}
	return c.becomeMember(ctx, rep, mode, recs)
}

// joinable checks that this node may join cluster (its id, or "" when not
// known yet, as in pairing) with mode: it is in no cluster of more than
// itself, and a log holding records needs --requeue or --discard. It
// returns how many records the log holds.
func (c *cluster) joinable(cluster string, mode JoinMode) (int, error) {
	d := c.d
	n := d.node()
	members := n.Members()
	selfIn := slices.ContainsFunc(members, func(m replication.Member) bool { return m.ID == n.ID() })
	if lead := n.Leader(); len(members) > 1 || !selfIn || (lead != 0 && lead != n.ID()) {
		// More members, another master, or not yet a member of its own
		// membership (still catching up after a join): in a cluster.
		if cluster != "" && cluster == c.clusterID() {
			return 0, errors.New("this gateway is already a member of that cluster")
		}
		which := "another cluster"
		if cluster == "" {
			which = "a cluster"
		}
		return 0, fmt.Errorf("this gateway is a member of %s (%s, %d gateways): remove it there first (tandem cluster remove %s, on that cluster's master)", which, c.clusterID(), len(members), d.cfg.Node.Name)
	}
	recs, err := d.db.DataRecords()
	if err != nil {
		return 0, err
	}
	if recs > 0 && mode == JoinFresh {
		return 0, config.UsageError{Err: fmt.Errorf("this gateway's log holds %s: join with --requeue to publish them into the cluster, or with --discard to drop them", plural(recs, "record"))}
	}
	return recs, nil
}

// becomeMember makes this node a member of the cluster rep describes, once
// the master admitted it: rep must already be authenticated (a pinned
// certificate, or a pairing proof). recs is what joinable counted.
func (c *cluster) becomeMember(ctx context.Context, rep JoinReply, mode JoinMode, recs int) (JoinReply, error) {
	d := c.d
	// From here on this node belongs to the cluster: its own raft state
	// goes (its records to the requeue bucket, if asked), and the
	// master's log brings it up to date, membership included.
	if err := d.restartNode(func() error {
		if err := d.db.ResetRaft(mode == JoinRequeue); err != nil {
			return err
		}
		if err := c.startCatchUp(rep); err != nil {
			return err
		}
		return c.setMeta(d.db, rep.Cluster, rep.Generation)
	}, true, rep.Commit); err != nil {
		return JoinReply{}, err
	}
	c.setFloor(rep.Members)
	c.tr.Reconnect()
	// Answer once the master is in contact, so that what the operator
	// runs next (tandem status) already shows the cluster; a master slow
	// to dial back is not a failed join, though.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_ = d.node().WaitLeader(wctx)
	cancel()
	if len(rep.Members) >= 3 {
		// The third gateway joins as a learner and votes once the keeper
		// promotes it, when it has caught up (the 2-gateway slave is
		// promoted the same way, not always first); until both are voters
		// the cluster has two, and losing the master would leave no
		// majority. The join answers once all three vote (or, for a long
		// catch-up, says they do not yet).
		wctx, cancel := context.WithTimeout(ctx, voterWait)
		if !c.waitVoter(wctx) {
			d.log.Warn("joined as a learner, not yet a voter: it becomes one once it has caught up with the master", "cluster", rep.Cluster)
		}
		cancel()
	}
	attrs := []any{"cluster", rep.Cluster, "master", rep.Master}
	if mode != JoinFresh { // a fresh gateway had no records to requeue or discard: no mode=""
		attrs = append(attrs, "mode", string(mode), "records", recs)
	}
	d.log.Info("joined the cluster", attrs...)
	return rep, nil
}

// voterWait bounds how long a join waits for the third member's promotion
// to voter (the API client waits 90 s for the whole join).
const voterWait = 60 * time.Second

// waitVoter waits until every member votes, this node included, or ctx
// ends; it reports whether they do.
func (c *cluster) waitVoter(ctx context.Context) bool {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		if c.allVote() {
			return true
		}
		select {
		case <-ctx.Done():
			return c.allVote()
		case <-t.C:
		}
	}
}

// allVote reports whether every member of this node's membership, itself
// included, is a voter.
func (c *cluster) allVote() bool {
	ms := c.d.node().Members()
	for _, m := range ms {
		if !m.Voter {
			return false
		}
	}
	return c.isVoter()
}

// isVoter reports whether this node is a voter of its membership.
func (c *cluster) isVoter() bool {
	n := c.d.node()
	for _, m := range n.Members() {
		if m.ID == n.ID() {
			return m.Voter
		}
	}
	return false
}

// remove takes a member out of the cluster, on the master.
func (c *cluster) remove(ctx context.Context, which string, force bool) (string, error) {
	d := c.d
	n := d.node()
	ms := n.Members()
	var target *replication.Member
	for i, m := range ms {
		id := replication.IDString(m.ID)
		if which == m.Name || which == id || (len(which) >= 8 && strings.HasPrefix(id, which)) {
			if target != nil {
				return "", fmt.Errorf("%q names more than one member: use its id", which)
			}
			target = &ms[i]
		}
	}
	if target == nil {
		return "", fmt.Errorf("%q is not a member of this cluster (members: %s)", which, strings.Join(memberNames(ms), ", "))
	}
	if target.ID == n.ID() {
		if len(ms) == 1 {
			return "", replication.ErrLastVoter
		}
		return "", fmt.Errorf("%s is the master: it cannot remove itself; stop it and promote a slave, or remove the others", target.Name)
	}
	left := len(ms) - 1
	if min := d.cfg.Cluster.MinSyncReplicas; left-1 < min && d.hasSyncTopics() && !force {
		return "", fmt.Errorf("removing %s leaves %d gateway(s): with min_sync_replicas %d the sync topics could no longer be acked (use --force to remove it anyway)", target.Name, left, min)
	}
	if err := n.ChangeMember(ctx, raftpb.ConfChangeRemoveNode, replication.Member{ID: target.ID}); err != nil {
		return "", err
	}
	d.log.Info("member removed", "peer", target.Name, "id", replication.IDString(target.ID))
	c.tellRemoved(ctx, target.ID)
	return target.Name, nil
}

// hasSyncTopics reports whether any topic rule in force asks for sync acks.
func (d *Gateway) hasSyncTopics() bool {
	for _, r := range d.host.Live().Topics {
		if r.Ack == "sync" {
			return true
		}
	}
	return false
}

// plural gives "1 record", "2 records": a person reads these lines.
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
