package replication

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
)

// timeoutMs is the requester's remaining patience for the request frame.
func timeoutMs(ctx context.Context) (uint32, error) {
	d, ok := ctx.Deadline()
	if !ok {
		return 0, nil
	}
	left := time.Until(d)
	if left <= 0 {
		return 0, context.DeadlineExceeded
	}
	return uint32(min(max(left.Milliseconds(), 1), math.MaxUint32)), nil
}

// runConn runs link c of peer p (in slot out or in) until it fails.
func (t *PeerTransport) runConn(c *conn, p *peer, slot *atomic.Pointer[conn]) {
	defer t.untrack(c.tc.NetConn())
	old, ok := p.attach(slot, c)
	if !ok {
		c.close(ErrPeerUnknown)
		return
	}
	if old != nil {
		old.close(errors.New("replaced by a newer link"))
	}
	writerDone := make(chan struct{})
	t.goChild(func() {
		defer close(writerDone)
		c.close(c.writeLoop())
	})
	c.close(c.readLoop())
	<-writerDone
	p.detach(slot, c)
	// Only a link that carried a frame was announced: one that dies at
	// once is a refusal, which the refusing side logs.
	level := slog.LevelDebug
	if c.announced && t.ctx.Err() == nil {
		level = slog.LevelInfo
	}
	t.log.Log(context.Background(), level, "peer link down", "peer", IDString(p.id), "addr", c.addr, "dialled", c.outbound, "error", c.err)
	t.noteUnreachable(p.id)
}

// errConnClosed means a link closed before a request was queued on it.
var errConnClosed = errors.New("replication: link closed")

// queued is a raft message waiting for the writer, with its size.
type queued struct {
	m    pb.Message
	size int
}

// conn is one established link: a reader (runConn's goroutine) and a
// writer goroutine that drains the queues in batches.
type conn struct {
	t        *PeerTransport
	tc       *tls.Conn
	fr       *frameReader
	peer     uint64
	addr     string
	outbound bool
	ctx      context.Context // cancelled when the link closes; handlers stop
	cancel   context.CancelFunc

	mu        sync.Mutex // guards raftQ, raftBytes, ctrl, ctrlBytes, closed
	raftQ     []queued
	raftBytes int
	ctrl      [][]byte // encoded request and response frames
	ctrlBytes int
	closed    bool
	sig       chan struct{} // capacity 1: the writer has work

	closeOnce sync.Once
	err       error // why it closed; set once, read after close
	announced bool  // the reader logged the link up (reader-owned)

	nextReq  atomic.Uint64
	reqMu    sync.Mutex // guards pending
	pending  map[uint64]chan responseFrame
	handlers atomic.Int32 // OnRequest calls in flight
}

func (t *PeerTransport) newConn(tc *tls.Conn, fr *frameReader, id uint64, addr string, outbound bool) *conn {
	fr.max = MaxFrameSize
	c := &conn{t: t, tc: tc, fr: fr, peer: id, addr: addr, outbound: outbound, sig: make(chan struct{}, 1), pending: map[uint64]chan responseFrame{}}
	c.ctx, c.cancel = context.WithCancel(t.ctx)
	return c
}

// fits applies the queue bound: an empty queue takes anything, so one
// message larger than the byte bound still goes, alone.
func (c *conn) fitsLocked(n, bytes, size int) bool {
	return n == 0 || n < c.t.cfg.QueueMessages && bytes+size <= c.t.cfg.QueueBytes
}

func (c *conn) enqueueRaft(m pb.Message, size int) bool {
	c.mu.Lock()
	ok := !c.closed && c.fitsLocked(len(c.raftQ), c.raftBytes, size)
	if ok {
		c.raftQ = append(c.raftQ, queued{m, size})
		c.raftBytes += size
	}
	c.mu.Unlock()
	if ok {
		signal(c.sig)
	}
	return ok
}

func (c *conn) enqueueCtrl(frame []byte) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		return errConnClosed
	case !c.fitsLocked(len(c.ctrl), c.ctrlBytes, len(frame)):
		return fmt.Errorf("%w (%w): %s: send queue full", ErrPeerUnreachable, ErrNotSent, IDString(c.peer))
	}
	c.ctrl = append(c.ctrl, frame)
	c.ctrlBytes += len(frame)
	signal(c.sig)
	return nil
}

// close ends the link once: queued raft messages count as dropped, pending
// requests and handlers are released, the socket is cut (not closed
// gracefully: a peer that stopped reading must not hold us up).
func (c *conn) close(err error) {
	c.closeOnce.Do(func() {
		c.mu.Lock()
		c.closed = true
		lost := c.raftQ
		c.raftQ, c.ctrl = nil, nil
		c.mu.Unlock()
		c.err = err
		c.cancel()
		c.tc.NetConn().Close()
		if len(lost) > 0 {
			c.t.stats.dropped.Add(uint64(len(lost)))
			c.t.noteUnreachable(c.peer)
			for _, q := range lost {
				if q.m.Type == pb.MsgSnap {
					c.t.noteSnapshot(c.peer, false)
				}
			}
		}
	})
}

// writeLoop drains the queues: control frames, then the raft messages in
// frames of up to maxBatchBytes, then one flush; a ping when idle.
func (c *conn) writeLoop() error {
	t := c.t
	bw := bufio.NewWriterSize(c.tc, 64<<10)
	ping := time.NewTicker(t.cfg.IdleTimeout / 3)
	defer ping.Stop()
	var buf []byte
	var spare []queued
	var batch []pb.Message
	wrote, needPing := false, false
	for {
		select {
		case <-c.ctx.Done():
			return nil
		case <-ping.C:
			needPing, wrote = !wrote, false
		case <-c.sig:
		}
		c.mu.Lock()
		msgs, ctrl := c.raftQ, c.ctrl
		c.raftQ, c.ctrl, c.raftBytes, c.ctrlBytes = spare, nil, 0, 0
		c.mu.Unlock()
		if len(msgs) == 0 && len(ctrl) == 0 && !needPing {
			spare = msgs // empty: the queue now holds the old spare
			continue
		}
		c.tc.SetWriteDeadline(time.Now().Add(t.cfg.IdleTimeout))
		frames, bytes := 0, 0
		if needPing && len(msgs) == 0 && len(ctrl) == 0 {
			ctrl = append(ctrl, appendFrame(nil, framePing, nil))
		}
		needPing = false
		for _, f := range ctrl {
			if _, err := bw.Write(f); err != nil {
				return err
			}
			frames, bytes = frames+1, bytes+len(f)
		}
		var snaps int
		for rest := msgs; len(rest) > 0; {
			n, size := 0, 0
			for n < len(rest) && (n == 0 || size+rest[n].size <= maxBatchBytes) {
				size += rest[n].size
				n++
			}
			batch = batch[:0]
			for _, q := range rest[:n] {
				batch = append(batch, q.m)
				if q.m.Type == pb.MsgSnap {
					snaps++
				}
			}
			var err error
			buf, err = appendRaftFrame(buf[:0], batch)
			clear(batch)
			if err != nil {
				return err
			}
			if _, err := bw.Write(buf); err != nil {
				return err
			}
			frames, bytes = frames+1, bytes+len(buf)
			rest = rest[n:]
		}
		if err := bw.Flush(); err != nil {
			return err
		}
		wrote = true
		t.stats.framesSent.Add(uint64(frames))
		t.stats.bytesSent.Add(uint64(bytes))
		t.stats.msgsSent.Add(uint64(len(msgs)))
		for range snaps {
			t.noteSnapshot(c.peer, true)
		}
		if cap(buf) > 2*maxBatchBytes {
			buf = nil // a rare huge message need not pin its buffer
		}
		clear(msgs) // release the entries' data
		spare = msgs[:0]
	}
}

// readLoop reads frames until the link fails; nothing arriving within
// IdleTimeout (pings included) counts as failure.
func (c *conn) readLoop() error {
	t := c.t
	for {
		c.tc.SetReadDeadline(time.Now().Add(t.cfg.IdleTimeout))
		typ, body, err := c.fr.next()
		if err != nil {
			return err
		}
		t.stats.framesRecv.Add(1)
		if !c.announced {
			c.announced = true
			t.log.Info("peer link up", "peer", IDString(c.peer), "addr", c.addr, "dialled", c.outbound)
		}
		t.stats.bytesRecv.Add(uint64(frameHeaderLen + len(body)))
		switch typ {
		case frameRaft:
			err = c.deliverRaft(body)
		case frameRequest:
			err = c.handleRequest(body)
		case frameResponse:
			err = c.handleResponse(body)
		case framePing:
		default:
			err = fmt.Errorf("%w: unexpected frame type %d", errBadFrame, typ)
		}
		if err != nil {
			return err
		}
	}
}

// deliverRaft hands a batch to OnRaft, minus messages not From the
// authenticated peer or not To this node, and raft's local message types:
// a member must not speak for another, nor inject MsgHup and the like.
func (c *conn) deliverRaft(body []byte) error {
	msgs, err := decodeRaftBatch(body)
	if err != nil {
		return err
	}
	keep := msgs[:0]
	for _, m := range msgs {
		if m.From == c.peer && m.To == c.t.id && !raft.IsLocalMsg(m.Type) {
			keep = append(keep, m)
		}
	}
	if bad := len(msgs) - len(keep); bad > 0 {
		c.t.logLimited("forged|"+IDString(c.peer), slog.LevelWarn, "dropped raft messages with a wrong sender, recipient or type", "peer", IDString(c.peer), "count", bad)
	}
	if len(keep) > 0 {
		c.t.stats.msgsRecv.Add(uint64(len(keep)))
		c.t.cfg.OnRaft(c.peer, keep)
	}
	return nil
}

// handleRequest runs OnRequest on a goroutine of its own, so a slow
// handler holds up neither raft traffic nor other requests. Past
// maxHandlers in flight it answers "busy" at once rather than stop reading:
// the raft frames behind it may be what the handlers wait for.
func (c *conn) handleRequest(body []byte) error {
	req, err := decodeRequest(body)
	if err != nil {
		return err
	}
	if c.handlers.Add(1) > maxHandlers {
		c.handlers.Add(-1)
		c.enqueueCtrl(appendResponse(nil, responseOf(req.id, nil, errors.New("too many requests in flight"), MaxFrameSize)))
		return nil
	}
	req.payload = slices.Clone(req.payload)
	c.t.goChild(func() {
		defer c.handlers.Add(-1)
		ctx, cancel := c.ctx, context.CancelFunc(func() {})
		if req.timeoutMs > 0 {
			ctx, cancel = context.WithTimeout(c.ctx, time.Duration(req.timeoutMs)*time.Millisecond)
		}
		reply, err := c.t.cfg.OnRequest(ctx, c.peer, req.kind, req.payload)
		late := ctx.Err() != nil
		cancel()
		if late {
			// The requester's deadline passed (it reports its own
			// timeout) or the link closed: an answer would be wasted.
			return
		}
		c.enqueueCtrl(appendResponse(nil, responseOf(req.id, reply, err, MaxFrameSize)))
	})
	return nil
}

func (c *conn) handleResponse(body []byte) error {
	r, err := decodeResponse(body)
	if err != nil {
		return err
	}
	c.reqMu.Lock()
	ch := c.pending[r.id]
	delete(c.pending, r.id)
	c.reqMu.Unlock()
	if ch != nil { // nil: the requester gave up
		r.payload = slices.Clone(r.payload)
		ch <- r
	}
	return nil
}

// request sends one request on c and waits for its response.
func (c *conn) request(ctx context.Context, kind byte, payload []byte) ([]byte, error) {
	ms, err := timeoutMs(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w (%w)", err, ErrNotSent)
	}
	id := c.nextReq.Add(1)
	ch := make(chan responseFrame, 1)
	c.reqMu.Lock()
	c.pending[id] = ch
	c.reqMu.Unlock()
	defer func() {
		c.reqMu.Lock()
		delete(c.pending, id)
		c.reqMu.Unlock()
	}()
	if err := c.enqueueCtrl(appendRequest(nil, requestFrame{id: id, timeoutMs: ms, kind: kind, payload: payload})); err != nil {
		return nil, err
	}
	var r responseFrame
	select {
	case r = <-ch:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-c.ctx.Done():
		select {
		case r = <-ch: // answered just before the link closed
		default:
			return nil, fmt.Errorf("%w: link to %s lost before the answer", ErrPeerUnreachable, IDString(c.peer))
		}
	}
	if r.status == statusError {
		return nil, fmt.Errorf("%w: %s", ErrRemote, r.payload)
	}
	return r.payload, nil
}
