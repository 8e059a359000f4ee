package cluster

// Pairing: `tandem pair open` on a member makes the master hold a short
// code; `tandem pair join CODE` on a fresh gateway finds that master over
// mDNS (TXT pair=open) and knocks on its peer port with a proof of the
// code. The proof is an HMAC keyed by the code and computed over both
// certificate fingerprints and the TLS session's exporter value
// (replication.Remote.Binding), so a relay in the middle, which must run
// two TLS sessions, cannot pass it on. The joiner proves first; the master
// answers with its own proof over the same binding plus the join reply,
// and the joiner checks that before it resets anything. From there on it
// is a token join: addMember on the master, becomeMember on the joiner.
//
// A code is 12 symbols of Crockford's base32 (60 bits). Guessing online is
// what the master limits, for the code as a whole and not per source
// address, since a stranger with forty addresses would otherwise get forty
// times the guesses: at most pairGuessBurst checked guesses at once and
// one a second after that, from all sources together; a guess over that
// cap is refused unchecked and counts as nothing. PairMaxFailures wrong
// codes in total close the pairing until `tandem pair open` is run again.
// So one opened code admits at most 5 checked guesses: the chance that an
// attacker hits a code is 5 in 2^60 (about 4e-18) per `pair open`, and
// the expected number of guesses to hit one is 2^59 (about 5.8e17), which
// at the cap's one a second is some 1.8e10 years, or 2.3e17 pairings
// opened for it. The price is that a stranger on the LAN can close a
// pairing with five wrong codes: loud (each wrong code and the closing are
// logged with the address), and undone by opening a new code. Offline
// guessing from a captured proof meets scrypt before each HMAC.

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/scrypt"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/discovery"
	"github.com/tandem-edge/tandem/replication"
)

const (
	// DefaultPairTTL is how long a pairing code stays valid.
	DefaultPairTTL = 10 * time.Minute
	// pairCodeLen is the number of symbols in a code: 5 bits each.
	pairCodeLen = 12
	// PairMaxFailures wrong codes in total, from any sources, close the
	// pairing: `tandem pair open` must be run again.
	PairMaxFailures = 5
	// pairGuessEvery is the pace of checked guesses, from all sources
	// together, once the burst is spent; the joiner waits a little more
	// than this before it asks again after a refusal for the cap.
	pairGuessEvery = time.Second
	// pairGuessBurst checked guesses may come at once: a joiner that
	// mistyped the code tries again at once without meeting the cap.
	pairGuessBurst = 3
)

// pairAlphabet is Crockford's base32: digits and capitals without I, L, O
// and U, which read like 1, 1, 0 and V (or spell words) when read aloud.
const pairAlphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"

// PairKDFCost is scrypt's N for the code's key. A 60-bit code is out of
// reach online; scrypt makes a captured proof costly to attack offline
// too (32 MiB, well under a second on a gateway-class core); tests lower
// it.
var PairKDFCost = 1 << 15

// Stable phrases of the master's refusals: the joiner reads errBusy's.
var (
	errPairClosed  = errors.New("pairing is not open on this gateway (run tandem pair open on a member)")
	errPairExpired = errors.New("the pairing code expired: open a new one (tandem pair open)")
	errPairUsed    = errors.New("the pairing code was already used: each code pairs one gateway")
	errPairBusy    = errors.New("pairing attempts are limited to one a second: try again in a second")
	// ErrPairWrong is a checked guess that was not the code.
	ErrPairWrong = errors.New("wrong pairing code")
	// ErrPairLocked is any attempt once PairMaxFailures wrong codes closed
	// the pairing.
	ErrPairLocked = errors.New("too many wrong pairing codes: the pairing is closed, open a new one (tandem pair open)")
)

// newPairCode returns a fresh random code in its grouped form.
func newPairCode() (string, error) {
	b := make([]byte, pairCodeLen)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	for i := range b {
		b[i] = pairAlphabet[b[i]&31] // 256 is a multiple of 32: no bias
	}
	return formatPairCode(string(b)), nil
}

// formatPairCode groups a canonical code in fours for reading aloud.
func formatPairCode(canon string) string {
	var sb strings.Builder
	for i := 0; i < len(canon); i += 4 {
		if i > 0 {
			sb.WriteByte('-')
		}
		sb.WriteString(canon[i:min(i+4, len(canon))])
	}
	return sb.String()
}

// ParsePairCode reads a code as a person may type it: any case, with or
// without dashes or spaces, O for 0 and I or L for 1. It returns the
// canonical form (12 symbols, no dashes) that the key is derived from.
func ParsePairCode(s string) (string, error) {
	var sb strings.Builder
	for _, r := range strings.ToUpper(s) {
		switch {
		case r == '-' || r == ' ' || r == '\t':
			continue
		case r == 'O':
			r = '0'
		case r == 'I' || r == 'L':
			r = '1'
		}
		if r > 127 || !strings.ContainsRune(pairAlphabet, r) {
			return "", fmt.Errorf("invalid pairing code: %q is not one of its symbols (0-9 and A-Z without U)", r)
		}
		sb.WriteRune(r)
	}
	if sb.Len() != pairCodeLen {
		return "", fmt.Errorf("invalid pairing code: %d symbols, a code has %d (like 7KQF-M2XA-9RTD)", sb.Len(), pairCodeLen)
	}
	return sb.String(), nil
}

// PairKey derives the MAC key from a canonical code.
func PairKey(canon string) []byte {
	k, err := scrypt.Key([]byte(canon), []byte("tandem-pair-v1"), PairKDFCost, 8, 1, 32)
	if err != nil {
		panic(err) // only for parameters out of range: a constant here
	}
	return k
}

// Roles of a pairing MAC: which side computed it, so one side's proof is
// never valid as the other's.
const (
	PairRoleJoiner byte = 'J'
	pairRoleMaster byte = 'M'
)

// PairMAC is HMAC-SHA256(key, "tandem-pair" || role || fpJoiner ||
// fpMaster || binding || extra). The fixed-size fields come first, so the
// encoding is unambiguous; extra is the master's reply.
func PairMAC(key []byte, role byte, fpJoiner, fpMaster [32]byte, binding, extra []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("tandem-pair"))
	m.Write([]byte{role})
	m.Write(fpJoiner[:])
	m.Write(fpMaster[:])
	m.Write(binding)
	m.Write(extra)
	return m.Sum(nil)
}

// PairRequest is the joiner's knock: who it is and its proof.
type PairRequest struct {
	Member replication.Member `json:"member"`
	MAC    []byte             `json:"mac"`
}

// PairReply is the master's answer: the join reply as sent, and its proof
// over it.
type PairReply struct {
	Reply json.RawMessage `json:"reply"`
	MAC   []byte          `json:"mac"`
}

// pairing is one open code, held by its key only.
type pairing struct {
	key      []byte
	expires  time.Time
	failures int       // wrong codes, from every source
	tokens   float64   // checked guesses the cap allows now, up to pairGuessBurst
	filled   time.Time // when tokens was last brought up to date
	usedBy   uint64    // the node that paired with it, 0 while unused
}

// closed reports whether the wrong codes closed p.
func (p *pairing) closed() bool { return p.failures >= PairMaxFailures }

// Outcomes of a pairing attempt, the "outcome" label of
// tandem_pair_guesses_total.
const (
	pairRight   = iota // checked: the code
	pairWrong          // checked: not the code
	pairOverCap        // refused unchecked: over the global cap
	pairClosed         // refused unchecked: none open, expired, used or closed
	numPairOutcomes
)

// PairOutcomes names the outcomes PairGuesses counts, in its order.
var PairOutcomes = [numPairOutcomes]string{"right", "wrong", "over_cap", "closed"}

// pairBook holds the master's open pairing, in memory only (a restart
// closes it). At most one is open: a new `pair open` replaces it.
type pairBook struct {
	mu  sync.Mutex // guards cur and clock
	cur *pairing
	// clock is the time source of the master's checks; nil is time.Now.
	// Tests step it past the rate limit instead of waiting.
	clock func() time.Time
	// guesses counts attempts by outcome since the start.
	guesses [numPairOutcomes]atomic.Uint64
}

// now is the book's clock.
func (b *pairBook) now() time.Time {
	b.mu.Lock()
	clock := b.clock
	b.mu.Unlock()
	if clock != nil {
		return clock()
	}
	return time.Now()
}

// open makes key the open pairing until expires, with the cap's burst
// whole: a new code starts with no wrong guesses against it.
func (b *pairBook) open(key []byte, expires time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cur = &pairing{key: key, expires: expires, tokens: pairGuessBurst}
}

// state reports whether a pairing is open for a new gateway at now.
func (b *pairBook) state(now time.Time) (bool, time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if p := b.cur; p != nil && p.usedBy == 0 && !p.closed() && now.Before(p.expires) {
		return true, p.expires
	}
	return false, time.Time{}
}

// try checks a proof from node at now. macOf computes the expected MAC
// from the key. On success the pairing is marked used by node (the same
// node may try again: a joiner whose answer was lost retries) and its key
// is returned for the master's own proof. Checked guesses are capped for
// the pairing as a whole, whoever sends them (see the file's comment); a
// guess over the cap is refused before it is checked and is no failure.
// failures says how many wrong codes the pairing has seen; the one that
// reaches PairMaxFailures closes it.
func (b *pairBook) try(node uint64, mac []byte, macOf func(key []byte) []byte, now time.Time) (p *pairing, failures int, err error) {
	out := pairClosed
	defer func() { b.guesses[out].Add(1) }()
	b.mu.Lock()
	defer b.mu.Unlock()
	p = b.cur
	switch {
	case p == nil:
		return nil, 0, errPairClosed
	case !now.Before(p.expires):
		b.cur = nil
		return nil, p.failures, errPairExpired
	case p.closed():
		return nil, p.failures, ErrPairLocked
	case p.usedBy != 0 && p.usedBy != node:
		return nil, p.failures, errPairUsed
	}
	if now.After(p.filled) {
		p.tokens = min(pairGuessBurst, p.tokens+float64(now.Sub(p.filled))/float64(pairGuessEvery))
		p.filled = now
	}
	if p.tokens < 1 {
		out = pairOverCap
		return nil, p.failures, errPairBusy
	}
	p.tokens--
	if !hmac.Equal(mac, macOf(p.key)) {
		out = pairWrong
		p.failures++
		if p.closed() {
			return nil, p.failures, fmt.Errorf("%w: %d wrong codes closed the pairing: open a new one (tandem pair open)", ErrPairWrong, p.failures)
		}
		return nil, p.failures, ErrPairWrong
	}
	out = pairRight
	p.usedBy = node
	return p, p.failures, nil
}

// counts is the attempts since the start, by outcome (PairOutcomes).
func (b *pairBook) counts() [numPairOutcomes]uint64 {
	var n [numPairOutcomes]uint64
	for i := range n {
		n[i] = b.guesses[i].Load()
	}
	return n
}

// release makes p usable again after its node could not be added.
func (b *pairBook) release(p *pairing) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cur == p {
		p.usedBy = 0
	}
}

// check is onPair's verdict on a proof from r, who claims to be name: it
// tries the book and logs what the master's operator must know: each wrong
// code with the address, and the one that closes the pairing with a line
// saying so; refusals nothing was checked for are debug lines, so a
// stranger knocking in a loop does not flood the journal.
func (b *pairBook) check(ctx context.Context, log *slog.Logger, r replication.Remote, name string, mac []byte, macOf func(key []byte) []byte) (*pairing, error) {
	p, failures, err := b.try(r.ID, mac, macOf, b.now())
	switch {
	case err == nil:
	case errors.Is(err, ErrPairWrong) && failures >= PairMaxFailures:
		log.Warn("pairing closed: too many wrong codes; run tandem pair open again", "from", r.Addr, "peer", replication.IDString(r.ID), "name", name, "failures", failures)
	case errors.Is(err, errPairBusy) || errors.Is(err, ErrPairLocked):
		log.Debug("pairing attempt refused", "from", r.Addr, "peer", replication.IDString(r.ID), "name", name, "reason", err, "failures", failures)
	default:
		log.Warn("pairing attempt refused", "from", r.Addr, "peer", replication.IDString(r.ID), "name", name, "reason", err, "failures", failures)
	}
	return p, err
}

// openPairing opens pairing on this node, the master, and returns the code.
func (c *cluster) openPairing(ttl time.Duration) (string, time.Time, error) {
	if ttl <= 0 {
		ttl = DefaultPairTTL
	}
	if len(c.d.node().Members()) >= replication.MaxMembers {
		return "", time.Time{}, fmt.Errorf("the cluster already has %d gateways, the most tandem runs: remove one first", replication.MaxMembers)
	}
	code, err := newPairCode()
	if err != nil {
		return "", time.Time{}, err
	}
	canon, _ := ParsePairCode(code)
	exp := c.invites.pair.now().Add(ttl)
	c.invites.pair.open(PairKey(canon), exp)
	// Never the code: the journal is readable by more people than the LAN.
	c.d.log.Info("pairing open", "expires", exp.UTC().Format(time.RFC3339))
	return code, exp, nil
}

// onPair answers a pairing knock on the peer port, on the master.
func (c *cluster) onPair(ctx context.Context, r replication.Remote, payload []byte) ([]byte, error) {
	var req PairRequest
	if err := json.Unmarshal(payload, &req); err != nil {
		c.d.log.Warn("pairing attempt refused", "from", r.Addr, "peer", replication.IDString(r.ID), "reason", "malformed request")
		return nil, errors.New("malformed pairing request")
	}
	m := req.Member
	if m.ID != r.ID || m.Fingerprint != r.Fingerprint {
		return nil, errors.New("the joining node's details do not match its certificate")
	}
	n := c.d.node()
	if n.Leader() != n.ID() {
		return nil, errors.New("this gateway is not the master: pairing is held by the master")
	}
	self := c.d.self().Fingerprint
	p, err := c.invites.pair.check(ctx, c.d.log, r, m.Name, req.MAC, func(key []byte) []byte {
		return PairMAC(key, PairRoleJoiner, r.Fingerprint, self, r.Binding, nil)
	})
	if err != nil {
		return nil, err
	}
	rep, err := c.addMember(ctx, m, func() { c.invites.pair.release(p) })
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(rep)
	if err != nil {
		return nil, err
	}
	c.d.log.Info("gateway paired", "from", r.Addr, "peer", m.Name, "id", replication.IDString(m.ID))
	return json.Marshal(PairReply{Reply: b, MAC: PairMAC(p.key, pairRoleMaster, r.Fingerprint, self, r.Binding, b)})
}

// pairState says whether pairing is open for a new gateway, and until when.
func (c *cluster) pairState() (open bool, expires time.Time) {
	return c.invites.pair.state(c.invites.pair.now())
}

// pairTarget is a gateway to knock on: its name and addresses.
type pairTarget struct {
	name  string
	addrs []string
}

// findPairTargets browses the LAN until a gateway other than this one has
// pairing open, or within ends.
func (c *cluster) findPairTargets(ctx context.Context, within time.Duration) ([]pairTarget, error) {
	d := c.d
	if !d.cfg.Discovery.MDNS {
		return nil, config.UsageError{Err: errors.New("discovery.mdns is off on this gateway: pairing finds the other gateway over mDNS (turn it on in the config, or use --addr HOST:PORT)")}
	}
	self := replication.IDString(d.id.ID)
	deadline := time.Now().Add(within)
	var lastErr error // a failed browse round, said only if nothing is found
	for {
		round := min(1500*time.Millisecond, time.Until(deadline))
		peers, err := discovery.Browse(ctx, discovery.BrowseOptions{Interface: d.cfg.Discovery.Interface, Timeout: round})
		if err != nil {
			// A round that could not ask (a socket refused) is not
			// the answer the user waits for: ask again until the
			// deadline, and say it only then.
			lastErr = err
			if ctx.Err() != nil || time.Until(deadline) < 100*time.Millisecond {
				return nil, fmt.Errorf("no gateway with pairing open found on the LAN within %v: mDNS failed: %w", within.Round(time.Second), lastErr)
			}
			select {
			case <-ctx.Done():
			case <-time.After(min(250*time.Millisecond, time.Until(deadline))):
			}
			continue
		}
		var out []pairTarget
		for _, p := range peers {
			if p.PairOpen && p.ID != self && len(p.Addrs) > 0 {
				out = append(out, pairTarget{name: p.Name, addrs: p.Addrs})
			}
		}
		if len(out) > 0 {
			return out, nil
		}
		if ctx.Err() != nil || time.Until(deadline) < 100*time.Millisecond {
			return nil, fmt.Errorf("no gateway with pairing open found on the LAN within %v: run tandem pair open on a member (both need discovery.mdns on, on the same LAN)", within.Round(time.Second))
		}
	}
}

// pairJoin makes this (fresh) node a member of the cluster whose master
// holds code: found over mDNS, or at addr when given.
func (c *cluster) pairJoin(ctx context.Context, code string, mode JoinMode, within time.Duration, addr string) (JoinReply, error) {
	d := c.d
	canon, err := ParsePairCode(code)
	if err != nil {
		return JoinReply{}, config.UsageError{Err: err}
	}
	recs, err := c.joinable("", mode)
	if err != nil {
		return JoinReply{}, err
	}
	var targets []pairTarget
	if addr != "" {
		targets = []pairTarget{{name: addr, addrs: []string{addr}}}
	} else if targets, err = c.findPairTargets(ctx, within); err != nil {
		return JoinReply{}, err
	}
	key := PairKey(canon)
	me := d.self()
	var errs []error
	for _, tg := range targets {
		rep, err := c.pairWith(ctx, tg, key, me)
		if err == nil {
			return c.becomeMember(ctx, rep, mode, recs)
		}
		errs = append(errs, fmt.Errorf("%s: %w", tg.name, err))
	}
	return JoinReply{}, fmt.Errorf("pairing failed: %w", errors.Join(errs...))
}

// pairWith knocks on one gateway with this node's proof and checks the
// master's. A refusal for the rate limit is retried a few times.
func (c *cluster) pairWith(ctx context.Context, tg pairTarget, key []byte, me replication.Member) (JoinReply, error) {
	var errs []error
	for _, addr := range tg.addrs {
		for try := 0; ; try++ {
			rep, err := c.pairKnock(ctx, addr, key, me)
			if err == nil {
				return rep, nil
			}
			if errors.Is(err, replication.ErrRemote) && strings.Contains(err.Error(), errPairBusy.Error()) && try < 3 {
				select {
				case <-time.After(pairGuessEvery + 100*time.Millisecond):
					continue
				case <-ctx.Done():
					return JoinReply{}, ctx.Err()
				}
			}
			if errors.Is(err, replication.ErrRemote) {
				// The master answered and refused: another
				// address of it would answer the same.
				return JoinReply{}, fmt.Errorf("refused: %w", unwrapRemote(err))
			}
			errs = append(errs, fmt.Errorf("%s: %w", addr, err))
			break
		}
	}
	return JoinReply{}, errors.Join(errs...)
}

// pairKnock is one attempt at addr.
func (c *cluster) pairKnock(ctx context.Context, addr string, key []byte, me replication.Member) (JoinReply, error) {
	// No pin: the gateway is known only from mDNS. Its certificate is
	// authenticated by its proof below, which covers its fingerprint.
	reply, r, err := c.tr.KnockWith(ctx, addr, [32]byte{}, replication.KnockPair, func(r replication.Remote) ([]byte, error) {
		if r.ID == me.ID {
			return nil, errors.New("that is this gateway itself")
		}
		return json.Marshal(PairRequest{Member: me, MAC: PairMAC(key, PairRoleJoiner, me.Fingerprint, r.Fingerprint, r.Binding, nil)})
	})
	if err != nil {
		return JoinReply{}, err
	}
	var pr PairReply
	if err := json.Unmarshal(reply, &pr); err != nil {
		return JoinReply{}, fmt.Errorf("malformed answer: %w", err)
	}
	if !hmac.Equal(pr.MAC, PairMAC(key, pairRoleMaster, me.Fingerprint, r.Fingerprint, r.Binding, pr.Reply)) {
		c.d.log.Warn("pairing: the answering gateway did not prove it knows the code", "addr", addr, "peer", replication.IDString(r.ID))
		return JoinReply{}, errors.New("the gateway there did not prove it knows the code (a relay or an impostor?): not joining it")
	}
	var rep JoinReply
	if err := json.Unmarshal(pr.Reply, &rep); err != nil {
		return JoinReply{}, fmt.Errorf("malformed join reply: %w", err)
	}
	// The members become pinned peers: the master that proved the code
	// must be among them with the certificate it showed.
	if !slices.ContainsFunc(rep.Members, func(m replication.Member) bool { return m.ID == r.ID && m.Fingerprint == r.Fingerprint }) {
		return JoinReply{}, errors.New("the master's answer does not list the master itself")
	}
	return rep, nil
}
