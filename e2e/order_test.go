package e2e

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/eclipse/paho.golang/packets"
)

// windowPublisher is an MQTT 5 device that keeps up to window QoS 1
// publishes in flight on one connection, written in order: what a device
// does that MQTT's per-client order protects (paho's blocking Publish
// keeps one in flight). Payloads are id-seq; it stops at the first
// connection failure, keeping what was acked.
type windowPublisher struct {
	id    string
	conn  net.Conn
	mu    sync.Mutex // guards acked, refused, err
	acked map[string]bool
	// refused counts PUBACKs with a failure reason (a sync_timeout, say).
	refused int
	err     error
	stopc   chan struct{}
	wg      sync.WaitGroup
}

func startWindowPublisher(t *testing.T, g *gw, id, topic string, window int) *windowPublisher {
	t.Helper()
	conn, err := dialIn(g.h, g.h.Addr()+":1883")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	cp := packets.NewControlPacket(packets.CONNECT)
	c := cp.Content.(*packets.Connect)
	c.ClientID, c.CleanStart, c.KeepAlive, c.ProtocolName, c.ProtocolVersion = id, true, 30, "MQTT", 5
	if _, err := cp.WriteTo(conn); err != nil {
		t.Fatal(err)
	}
	ack, err := packets.ReadPacket(conn)
	if err != nil || ack.Type != packets.CONNACK || ack.Content.(*packets.Connack).ReasonCode != 0 {
		t.Fatalf("connect %s: %v %+v", id, err, ack)
	}
	p := &windowPublisher{id: id, conn: conn, acked: map[string]bool{}, stopc: make(chan struct{})}
	slots := make(chan struct{}, window)
	var pidMu sync.Mutex
	pending := map[uint16]string{} // packet id → payload; pidMu
	p.wg.Add(2)
	go func() { // the reader: PUBACKs free a slot each
		defer p.wg.Done()
		for {
			pk, err := packets.ReadPacket(conn)
			if err != nil {
				p.fail(err)
				return
			}
			pa, ok := pk.Content.(*packets.Puback)
			if !ok {
				continue
			}
			pidMu.Lock()
			payload := pending[pa.PacketID]
			delete(pending, pa.PacketID)
			pidMu.Unlock()
			p.mu.Lock()
			if pa.ReasonCode < 0x80 {
				p.acked[payload] = true
			} else {
				p.refused++
			}
			p.mu.Unlock()
			<-slots
		}
	}()
	go func() { // the writer: one publish after another, in order
		defer p.wg.Done()
		for seq := 0; ; seq++ {
			select {
			case slots <- struct{}{}:
			case <-p.stopc:
				return
			}
			pid := uint16(seq%65535 + 1)
			payload := fmt.Sprintf("%s-%d", id, seq)
			pidMu.Lock()
			pending[pid] = payload
			pidMu.Unlock()
			pk := packets.NewControlPacket(packets.PUBLISH)
			pub := pk.Content.(*packets.Publish)
			pub.Topic, pub.QoS, pub.PacketID, pub.Payload = topic, 1, pid, []byte(payload)
			if _, err := pk.WriteTo(conn); err != nil {
				p.fail(err)
				return
			}
		}
	}()
	return p
}

func (p *windowPublisher) fail(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.mu.Unlock()
}

func (p *windowPublisher) ackedCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.acked)
}

// stop ends the publisher; it reports an error if its connection failed
// before (a refusal is counted, not an error).
func (p *windowPublisher) stop() error {
	p.mu.Lock()
	err := p.err
	p.mu.Unlock()
	close(p.stopc)
	p.conn.Close()
	p.wg.Wait()
	return err
}

// logOrder reads a stopped gateway's log with tandem inspect: the payloads
// in log order, but for the sync records a settlement aborted.
func logOrder(t *testing.T, g *gw) []string {
	t.Helper()
	out, err := exec.Command(tandemBin(t), "inspect", "--data", g.dir, "--json").Output()
	if err != nil {
		t.Fatalf("inspect %s: %v", g.name, err)
	}
	var got []string
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var r struct {
			Payload string `json:"payload"`
			Aborted bool   `json:"aborted"`
		}
		if err := dec.Decode(&r); err != nil {
			t.Fatal(err)
		}
		if r.Aborted {
			continue // refused after it was logged: no one ever gets it
		}
		b, _ := base64.StdEncoding.DecodeString(r.Payload)
		got = append(got, string(b))
	}
	return got
}

// checkOrder fails unless g's log holds every payload p acked, in the
// order p published them (each record after those published before it).
func checkOrder(t *testing.T, g *gw, pubs ...*windowPublisher) {
	t.Helper()
	log := logOrder(t, g)
	for _, p := range pubs {
		last, violations, dups, logged := -1, 0, 0, map[int]bool{}
		for _, payload := range log {
			s, ok := strings.CutPrefix(payload, p.id+"-")
			if !ok {
				continue
			}
			i, err := strconv.Atoi(s)
			if err != nil {
				continue
			}
			if logged[i] {
				dups++
				continue
			}
			logged[i] = true
			if i < last {
				violations++
			}
			last = max(last, i)
		}
		lost := 0
		for payload := range p.acked {
			i, _ := strconv.Atoi(strings.TrimPrefix(payload, p.id+"-"))
			if !logged[i] {
				lost++
			}
		}
		t.Logf("%s, %s: %d acked (%d refused), %d logged, %d out of order, %d logged twice, %d acked but lost", g.name, p.id, len(p.acked), p.refused, len(logged), violations, dups, lost)
		if violations > 0 || lost > 0 {
			t.Errorf("%s: %s's publishes: %d out of order, %d acked but lost", g.name, p.id, violations, lost)
		}
	}
}
