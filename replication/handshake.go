package replication

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"time"

	"github.com/tandem-edge/tandem/internal/version"
	"github.com/tandem-edge/tandem/storage"
)

// Stranger request kinds: the only two things a node whose fingerprint is
// not a member's may ask on the peer port (DESIGN.md, "Peer port").
const (
	KnockJoin byte = 'J' // present a join token's secret
	KnockPair byte = 'P' // present a pairing proof
)

// Knock makes the one request a stranger may make: it dials addr, checks
// that the certificate there hashes to pin (a zero pin accepts any: the
// caller must then authenticate the reply itself, e.g. a pairing proof
// bound to Remote.Fingerprint), sends kind and payload, and returns the
// reply and who answered. It needs no Start and no membership.
func (t *PeerTransport) Knock(ctx context.Context, addr string, pin [32]byte, kind byte, payload []byte) ([]byte, Remote, error) {
	if 2+len(payload) > maxSmallFrame {
		return nil, Remote{}, fmt.Errorf("%w: knock of %d bytes", ErrFrameTooLarge, len(payload))
	}
	return t.KnockWith(ctx, addr, pin, kind, func(Remote) ([]byte, error) { return payload, nil })
}

// KnockWith is Knock with a payload made once the handshake is done, from
// who answered: a proof bound to the server's fingerprint and to the
// connection (Remote.Binding) can only be computed then. An error from
// payload closes the connection without a knock and is returned as is.
func (t *PeerTransport) KnockWith(ctx context.Context, addr string, pin [32]byte, kind byte, payload func(Remote) ([]byte, error)) ([]byte, Remote, error) {
	if kind != KnockJoin && kind != KnockPair {
		return nil, Remote{}, fmt.Errorf("replication: knock kind %q is not a stranger kind", kind)
	}
	if t.ctx.Err() != nil {
		return nil, Remote{}, ErrTransportClosed
	}
	ctx, cancel := context.WithTimeout(ctx, handshakeTimeout+knockTimeout)
	defer cancel()
	defer context.AfterFunc(t.ctx, cancel)()
	tc, fr, r, err := t.dial(ctx, addr, pin, pin == [32]byte{}, purposeKnock)
	if err != nil {
		return nil, Remote{}, err
	}
	defer t.untrack(tc.NetConn())
	stop := context.AfterFunc(ctx, func() { tc.NetConn().SetDeadline(time.Unix(1, 0)) })
	defer stop()
	body, err := payload(r)
	if err != nil {
		return nil, r, err
	}
	if 2+len(body) > maxSmallFrame {
		return nil, r, fmt.Errorf("%w: knock of %d bytes", ErrFrameTooLarge, len(body))
	}
	if _, err := tc.Write(appendKnock(nil, kind, body)); err != nil {
		return nil, r, fmt.Errorf("%w: knock on %s: %v", ErrPeerUnreachable, addr, err)
	}
	fr.max = MaxFrameSize
	typ, body, err := fr.next()
	if err == nil && typ != frameResponse {
		err = fmt.Errorf("%w: frame type %d instead of the answer", errBadFrame, typ)
	}
	var resp responseFrame
	if err == nil {
		resp, err = decodeResponse(body)
	}
	switch {
	case err != nil && ctx.Err() != nil:
		return nil, r, ctx.Err()
	case err != nil:
		return nil, r, fmt.Errorf("%w: %s closed without an answer: %v", ErrPeerUnreachable, addr, err)
	case resp.status == statusError:
		return nil, r, fmt.Errorf("%w: %s", ErrRemote, resp.payload)
	}
	return slices.Clone(resp.payload), r, nil
}

// dial opens a TLS connection to addr and exchanges hellos.
//
// Why InsecureSkipVerify: Go's client verification wants a chain to a
// trusted root and a matching host name; our certificates are self-signed
// and peers are found by address. InsecureSkipVerify turns off only that
// check: VerifyConnection still runs and accepts exactly the certificate
// whose SHA-256 is pinned, and TLS 1.3 has already proved the server holds
// its key. A pin is stronger than a CA here: it names one node, not anyone
// a CA would vouch for.
func (t *PeerTransport) dial(ctx context.Context, addr string, pin [32]byte, anyCert bool, purpose byte) (*tls.Conn, *frameReader, Remote, error) {
	d := net.Dialer{Timeout: handshakeTimeout, KeepAlive: 15 * time.Second}
	if t.cfg.LocalAddr != nil {
		d.LocalAddr = t.cfg.LocalAddr
	}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, nil, Remote{}, fmt.Errorf("%w: %v", ErrPeerUnreachable, err)
	}
	if !t.track(nc) {
		nc.Close()
		return nil, nil, Remote{}, ErrTransportClosed
	}
	tc := tls.Client(nc, &tls.Config{
		MinVersion:         tls.VersionTLS13,
		Certificates:       []tls.Certificate{t.cfg.Identity.Cert},
		NextProtos:         []string{peerALPN},
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("peer sent no certificate")
			}
			if fp := sha256.Sum256(cs.PeerCertificates[0].Raw); !anyCert && fp != pin {
				return fmt.Errorf("%w: fingerprint %x…, pinned %x…", ErrPeerIdentity, fp[:8], pin[:8])
			}
			return nil
		},
	})
	r, _, fr, err := t.greet(ctx, tc, purpose, false)
	if err != nil {
		t.untrack(nc)
		return nil, nil, Remote{}, err
	}
	nc.SetDeadline(time.Time{})
	// The socket stays tracked, so Close can cut it, until the caller
	// untracks it.
	return tc, fr, r, nil
}

// greet completes the TLS handshake and the hellos within handshakeTimeout
// (on the accepting side firstHelloTimeout, or handshakeTimeout for a
// member host: acceptPatience; or ctx). The dialling side sends its hello first and reads the
// server's; the server only reads, and sends its own (sendHello) once it
// has decided: a stranger asking for a member link gets nothing back. greet
// checks the protocol version and that the id the hello claims is the one
// the certificate's key gives. The deadline stays set; callers clear it.
func (t *PeerTransport) greet(ctx context.Context, tc *tls.Conn, purpose byte, server bool) (Remote, byte, *frameReader, error) {
	nc := tc.NetConn()
	limit := handshakeTimeout
	if server {
		limit = acceptPatience(t.memberHost(hostOf(tc.RemoteAddr().String())), firstHelloTimeout)
	}
	deadline := time.Now().Add(limit)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	nc.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
	r, p, fr, err := t.greetIO(ctx, tc, purpose, server)
	if !stop() && err == nil {
		err = ctx.Err() // the deadline was knocked into the past
	}
	return r, p, fr, err
}

func (t *PeerTransport) greetIO(ctx context.Context, tc *tls.Conn, purpose byte, server bool) (Remote, byte, *frameReader, error) {
	if err := tc.HandshakeContext(ctx); err != nil {
		return Remote{}, 0, nil, fmt.Errorf("TLS handshake: %w", err)
	}
	cs := tc.ConnectionState()
	if cs.NegotiatedProtocol != peerALPN {
		return Remote{}, 0, nil, fmt.Errorf("not a tandem peer (ALPN %q)", cs.NegotiatedProtocol)
	}
	leaf := cs.PeerCertificates[0]
	r := Remote{Fingerprint: sha256.Sum256(leaf.Raw), Addr: tc.RemoteAddr().String()}
	binding, err := cs.ExportKeyingMaterial(BindingLabel, nil, 32)
	if err != nil {
		return Remote{}, 0, nil, fmt.Errorf("TLS exporter: %w", err)
	}
	r.Binding = binding
	if !server {
		if err := t.sendHello(tc, purpose); err != nil {
			return r, 0, nil, err
		}
	}
	fr := newFrameReader(tc, maxSmallFrame)
	typ, body, err := fr.next()
	if err != nil {
		return r, 0, nil, fmt.Errorf("reading hello: %w", err)
	}
	if typ != frameHello {
		return r, 0, nil, fmt.Errorf("%w: frame type %d before the hello", errBadFrame, typ)
	}
	h, err := decodeHello(body)
	if err != nil {
		return r, 0, nil, err
	}
	if h.version > peerProtocolMax || h.maxVersion < peerProtocolMin || h.maxVersion < h.version {
		return r, 0, nil, fmt.Errorf("peer speaks protocol versions %d to %d, this node %d to %d: upgrade the older one", h.version, h.maxVersion, peerProtocolMin, peerProtocolMax)
	}
	if key := NodeIDFromPublicKey(leaf.RawSubjectPublicKeyInfo); h.id != key {
		return r, 0, nil, fmt.Errorf("hello claims node %s, the certificate's key is node %s", IDString(h.id), IDString(key))
	}
	r.ID, r.Generation, r.ClusterID = h.id, h.gen, h.cluster
	r.Protocol, r.Level, r.Build = min(h.maxVersion, peerProtocolMax), int(h.level), h.build
	return r, h.purpose, fr, nil
}

func (t *PeerTransport) sendHello(tc *tls.Conn, purpose byte) error {
	h := hello{version: peerProtocolMin, maxVersion: peerProtocolMax, level: storage.FeatureLevel, build: version.Version,
		purpose: purpose, id: t.id, gen: t.cfg.Generation(), cluster: t.cfg.ClusterID()}
	_, err := tc.Write(appendHello(nil, h))
	return err
}

// sameCluster refuses a member link to a peer naming another cluster.
func (t *PeerTransport) sameCluster(r Remote) error {
	if mine := t.cfg.ClusterID(); mine != "" && r.ClusterID != "" && r.ClusterID != mine {
		return fmt.Errorf("peer is in cluster %q, this node in %q", r.ClusterID, mine)
	}
	return nil
}

// generationOK asks OnGeneration about a member's hello.
func (t *PeerTransport) generationOK(r Remote) error {
	if !t.cfg.OnGeneration(r.ID, r.Generation) {
		return fmt.Errorf("generation %d refused", r.Generation)
	}
	return nil
}

// dialPeer dials p at addr and admits the link.
func (t *PeerTransport) dialPeer(p *peer, addr string) (*conn, error) {
	tc, fr, r, err := t.dial(p.ctx, addr, p.fp, false, purposeLink)
	if err != nil {
		return nil, err
	}
	if r.ID != p.id {
		err = fmt.Errorf("%s answers as node %s", IDString(p.id), IDString(r.ID))
	}
	if err == nil {
		err = t.sameCluster(r)
	}
	if err == nil {
		err = t.generationOK(r)
	}
	if err == nil {
		err = t.levelOK(r)
	}
	if err != nil {
		t.untrack(tc.NetConn())
		t.refuse(addr, "peer refused", err)
		return nil, err
	}
	return t.newConn(tc, fr, p.id, addr, true), nil
}

func (t *PeerTransport) acceptLoop() {
	var delay time.Duration
	for {
		nc, err := t.ln.Accept()
		if err != nil {
			if t.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: back off as
			// net/http does rather than spin.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			t.logLimited("accept", slog.LevelWarn, "peer accept failed", "error", err)
			select {
			case <-time.After(delay):
			case <-t.ctx.Done():
				return
			}
			continue
		}
		delay = 0
		addr := nc.RemoteAddr().String()
		host := hostOf(addr)
		slot, victim, why := t.strangers.admit(nc, host, t.memberHost(host), time.Now())
		if victim != nil {
			t.stats.strangers[refusedEvicted].Add(1)
			t.logLimited("evict|"+victim.src, slog.LevelWarn, "peer stranger evicted: all stranger slots held, its address held the most",
				"addr", victim.addr, "held_since", victim.at.Format(time.RFC3339Nano), "for", addr)
		}
		if slot == nil {
			nc.Close()
			t.stats.strangers[why].Add(1)
			reason := "too many stranger connections from this address"
			if why == refusedFull {
				reason = "every stranger slot held, none to evict"
			}
			t.refuse(addr, reason, nil)
			continue
		}
		if !t.track(nc) {
			t.strangers.release(slot)
			nc.Close()
			return
		}
		t.goChild(func() { t.serve(nc, slot) })
	}
}

// serve runs an accepted connection, which holds a stranger slot until it
// proves to be a member's or its knock is answered: handshake, then one
// knock or a member link; anything else closes it.
func (t *PeerTransport) serve(nc net.Conn, slot *strangerSlot) {
	defer t.untrack(nc)
	defer t.strangers.release(slot)
	addr := nc.RemoteAddr().String()
	host := hostOf(addr)
	tc := tls.Server(nc, t.serverTLS)
	r, purpose, fr, err := t.greet(t.ctx, tc, purposeLink, true)
	if err != nil {
		if !slot.wasEvicted() { // an eviction was logged as such
			t.refuse(addr, "handshake failed", err)
		}
		return
	}
	if purpose == purposeKnock {
		if t.sendHello(tc, purposeLink) == nil {
			t.serveKnock(tc, fr, r, host, slot)
		}
		return
	}
	t.mu.RLock()
	p := t.byFP[r.Fingerprint]
	t.mu.RUnlock()
	switch {
	case p == nil:
		err = errors.New("unknown fingerprint; a stranger may only knock")
	case p.id != r.ID:
		err = fmt.Errorf("member %s's certificate, hello from %s", IDString(p.id), IDString(r.ID))
	case purpose != purposeLink:
		err = fmt.Errorf("unknown purpose %d", purpose)
	default:
		err = t.sameCluster(r)
	}
	if err != nil {
		t.refuse(addr, "member link refused", err) // closed without a word
		return
	}
	// A member: no longer a stranger, so no longer counted among them, nor
	// evictable by them (an eviction until now only cost it a redial).
	t.strangers.release(slot)
	if slot.wasEvicted() {
		return
	}
	// Our hello goes out before the generation verdict: a peer refused for
	// its generation still learns ours, which may be what it must act on.
	if err := t.sendHello(tc, purposeLink); err != nil {
		return
	}
	if err := t.generationOK(r); err != nil {
		t.refuse(addr, "member link refused", err)
		return
	}
	if err := t.levelOK(r); err != nil {
		t.refuse(addr, "member link refused", err)
		return
	}
	nc.SetDeadline(time.Time{})
	t.sawMember(p.id, host)
	t.runConn(t.newConn(tc, fr, p.id, addr, false), p, &p.in)
}

// serveKnock answers one knock from host, then closes. A second frame is
// never read. The stranger slot stays held, evictable, while the knock
// frame is awaited and the knock waits for its turn to be answered; it is
// no longer evictable once answering starts, and is given back when the
// answer is ready.
func (t *PeerTransport) serveKnock(tc *tls.Conn, fr *frameReader, r Remote, host string, slot *strangerSlot) {
	if t.cfg.OnStranger == nil {
		t.refuse(r.Addr, "knock refused: no handler", nil)
		return
	}
	member := t.memberHost(host)
	patience := acceptPatience(member, knockFrameTimeout)
	tc.SetReadDeadline(time.Now().Add(patience))
	typ, body, err := fr.next()
	var kind byte
	var payload []byte
	if err == nil && typ != frameKnock {
		err = fmt.Errorf("frame type %d instead of a knock", typ)
	}
	if err == nil {
		kind, payload, err = decodeKnock(body)
	}
	if err == nil && kind != KnockJoin && kind != KnockPair {
		err = fmt.Errorf("knock kind %d", kind)
	}
	if err != nil {
		if !slot.wasEvicted() {
			t.refuse(r.Addr, "bad knock", err)
		}
		return
	}
	// Handlers answer a stranger in milliseconds: wait for a turn rather
	// than refuse, for as long again as the knock frame had.
	if !t.knocks.acquireWait(host, member, time.Now().Add(patience), t.ctx.Done(), slot.evicted) {
		if !slot.wasEvicted() {
			t.refuse(r.Addr, "knock refused: too many at once", nil)
		}
		return
	}
	held := true
	release := func() {
		if held {
			held = false
			t.knocks.release(host)
			t.strangers.release(slot)
		}
	}
	defer release()
	if !t.strangers.answering(slot) {
		return // evicted just now
	}
	t.stats.knocks.Add(1)
	ctx, cancel := context.WithTimeout(t.ctx, knockTimeout)
	reply, herr := t.cfg.OnStranger(ctx, r, kind, slices.Clone(payload))
	cancel()
	// The slots bound the waiting and the handling; the answer's write and
	// the linger after it are the knocker's to end, and its next knock
	// (a retry, the next step of a join) may already be on its way.
	release()
	tc.SetWriteDeadline(time.Now().Add(handshakeTimeout))
	if _, err := tc.Write(appendResponse(nil, responseOf(0, reply, herr, MaxFrameSize))); err == nil {
		lingerClose(tc)
	}
}

// refuse counts a refused connection and logs it, once a minute per
// address and reason: scanners and peers stuck in a refusal loop must not
// flood the journal.
func (t *PeerTransport) refuse(addr, why string, err error) {
	t.stats.refused.Add(1)
	host, _, herr := net.SplitHostPort(addr)
	if herr != nil {
		host = addr
	}
	t.logLimited("refuse|"+host+"|"+why, slog.LevelWarn, "peer connection refused", "addr", addr, "reason", why, "error", err)
}

// lingerClose ends a connection after our last frame without a reset: had
// the other side sent bytes we never read, closing at once would make the
// kernel answer with RST, which can destroy our reply before it is read.
// What arrives meanwhile is discarded unread, and we wait a second at most.
func lingerClose(tc *tls.Conn) {
	tc.CloseWrite()
	nc := tc.NetConn()
	if tcp, ok := nc.(*net.TCPConn); ok {
		tcp.CloseWrite()
		nc.SetReadDeadline(time.Now().Add(time.Second))
		io.CopyN(io.Discard, nc, 256<<10)
	}
	nc.Close()
}
