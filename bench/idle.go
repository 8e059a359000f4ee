package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// idleKeepAlive is the keep-alive idle connections ask for; they ping at
// half of it.
const idleKeepAlive = 60 * time.Second

// IdleConns are MQTT connections that sent CONNECT, got their CONNACK and
// since then only keep the connection alive with PINGREQ: what a broker
// holds for a device that is connected and quiet. They are written by
// hand (a few bytes each way), so the load generator's own cost per
// connection stays one socket and one small reader goroutine.
type IdleConns struct {
	conns []net.Conn
	open  atomic.Int64
	stop  chan struct{}
	ping  sync.WaitGroup // the pinger
	read  sync.WaitGroup // one reader per connection
}

// OpenIdle opens n idle connections to o.Broker, speaking o.Version with
// o's credentials and client ids o.ClientID-idle-N, up to 32 connecting
// at a time. It returns once every one has its CONNACK, or with the first
// failure (and none left open).
func OpenIdle(ctx context.Context, o Options, n int) (*IdleConns, error) {
	o.fillConn()
	if o.Version != 3 && o.Version != 5 {
		return nil, errors.New("bench: mqtt version must be 3 or 5")
	}
	if err := RaiseFileLimit(uint64(n + 64)); err != nil {
		return nil, err
	}
	ic := &IdleConns{conns: make([]net.Conn, n), stop: make(chan struct{})}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var next atomic.Int64
	var firstErr error
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range min(n, 32) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				c, err := idleConnect(ctx, o, fmt.Sprintf("%s-idle-%d", o.ClientID, i))
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("idle connection %d: %w", i, err)
					}
					mu.Unlock()
					cancel()
					return
				}
				ic.conns[i] = c
			}
		}()
	}
	wg.Wait()
	if firstErr == nil && ctx.Err() != nil {
		firstErr = ctx.Err()
	}
	if firstErr != nil {
		for _, c := range ic.conns {
			if c != nil {
				c.Close()
			}
		}
		return nil, firstErr
	}
	ic.open.Store(int64(n))
	for _, c := range ic.conns {
		ic.read.Add(1)
		go ic.drain(c)
	}
	ic.ping.Add(1)
	go ic.pinger()
	return ic, nil
}

// Open returns how many of the connections are still open.
func (ic *IdleConns) Open() int { return int(ic.open.Load()) }

// Close sends each connection a DISCONNECT, waits up to 5 s for the
// broker to close them (so the broker's side holds the TIME_WAIT, not the
// load generator's ephemeral ports) and closes them all.
func (ic *IdleConns) Close() {
	close(ic.stop)
	ic.ping.Wait()
	for _, c := range ic.conns {
		_ = c.SetWriteDeadline(time.Now().Add(time.Second))
		_, _ = c.Write([]byte{0xe0, 0x00}) // DISCONNECT, normal
	}
	done := make(chan struct{})
	go func() { ic.read.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
	}
	for _, c := range ic.conns {
		c.Close()
	}
	<-done
}

// drain reads and drops what the broker sends (PINGRESPs) until the
// connection ends.
func (ic *IdleConns) drain(c net.Conn) {
	defer ic.read.Done()
	defer ic.open.Add(-1)
	buf := make([]byte, 16)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
	}
}

// pinger sends every connection a PINGREQ each half keep-alive.
func (ic *IdleConns) pinger() {
	defer ic.ping.Done()
	t := time.NewTicker(idleKeepAlive / 2)
	defer t.Stop()
	for {
		select {
		case <-ic.stop:
			return
		case <-t.C:
		}
		for _, c := range ic.conns {
			_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			_, _ = c.Write([]byte{0xc0, 0x00}) // PINGREQ
		}
	}
}

// idleConnect dials, sends CONNECT (clean start, no will) and checks the
// CONNACK.
func idleConnect(ctx context.Context, o Options, id string) (net.Conn, error) {
	c, err := (&net.Dialer{Timeout: 10 * time.Second}).DialContext(ctx, "tcp", o.Broker)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(15 * time.Second))
	if _, err := c.Write(connectPacket(o.Version, id, o.Username, o.Password, uint16(idleKeepAlive/time.Second))); err != nil {
		c.Close()
		return nil, err
	}
	typ, body, err := readPacket(c)
	switch {
	case err == io.EOF:
		err = errors.New("the broker closed the connection before its CONNACK (a connection limit or connect rate limit?)")
	case err != nil:
	case typ != 0x20 || len(body) < 2:
		err = fmt.Errorf("expected CONNACK, got packet type %#x", typ)
	case body[1] != 0:
		err = fmt.Errorf("connect refused: reason %#x", body[1])
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

// connectPacket encodes an MQTT 3.1.1 (version 3) or 5 CONNECT with clean
// start, no will and no properties.
func connectPacket(version int, id, user, pass string, keepAlive uint16) []byte {
	str := func(b []byte, s string) []byte { return append(append(b, byte(len(s)>>8), byte(len(s))), s...) }
	level, flags := byte(4), byte(0x02) // clean start
	if version == 5 {
		level = 5
	}
	if user != "" {
		flags |= 0x80 | 0x40
	}
	v := str(nil, "MQTT")
	v = append(v, level, flags, byte(keepAlive>>8), byte(keepAlive))
	if version == 5 {
		v = append(v, 0) // property length
	}
	v = str(v, id)
	if user != "" {
		v = str(str(v, user), pass)
	}
	p := []byte{0x10}
	for n := len(v); ; {
		b := byte(n & 0x7f)
		if n >>= 7; n > 0 {
			p = append(p, b|0x80)
			continue
		}
		p = append(p, b)
		break
	}
	return append(p, v...)
}

// readPacket reads one MQTT packet: its type (the fixed header's first
// byte, flags masked off) and its body.
func readPacket(r io.Reader) (byte, []byte, error) {
	var b [1]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return 0, nil, err
	}
	typ := b[0] & 0xf0
	n := 0
	for shift := 0; ; shift += 7 {
		if shift > 21 {
			return 0, nil, errors.New("malformed remaining length")
		}
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return 0, nil, err
		}
		n |= int(b[0]&0x7f) << shift
		if b[0]&0x80 == 0 {
			break
		}
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return 0, nil, err
	}
	return typ, body, nil
}
