package replication

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// TestKnockBinding: both ends of one knock see the same TLS exporter value
// in Remote.Binding, a second connection another, and KnockWith builds its
// payload from the Remote it is about to send on.
func TestKnockBinding(t *testing.T) {
	var mu sync.Mutex
	var served [][]byte
	b := newTP(t, tpIdentity(t), "", func(c *TransportConfig) {
		c.OnStranger = func(_ context.Context, r Remote, _ byte, payload []byte) ([]byte, error) {
			mu.Lock()
			served = append(served, r.Binding)
			mu.Unlock()
			if !bytes.Equal(payload, r.Binding) {
				return nil, errors.New("payload is not this connection's binding")
			}
			return []byte("ok"), nil
		}
	})
	b.tr.Start()
	a := newTP(t, tpIdentity(t), "", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var dialled [][]byte
	for range 2 {
		reply, r, err := a.tr.KnockWith(ctx, b.tr.Addr().String(), [32]byte{}, KnockPair, func(r Remote) ([]byte, error) {
			if r.Fingerprint != b.id.Fingerprint {
				t.Errorf("payload built for %x, want b", r.Fingerprint[:4])
			}
			return r.Binding, nil
		})
		if err != nil || string(reply) != "ok" {
			t.Fatalf("knock: %q %v", reply, err)
		}
		dialled = append(dialled, r.Binding)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(served) != 2 {
		t.Fatalf("%d knocks served", len(served))
	}
	for i := range 2 {
		if len(dialled[i]) != 32 || !bytes.Equal(dialled[i], served[i]) {
			t.Fatalf("connection %d: client binding %x, server %x", i, dialled[i], served[i])
		}
	}
	if bytes.Equal(dialled[0], dialled[1]) {
		t.Fatal("two connections share a binding")
	}

	// A payload func's error is returned and nothing is sent.
	boom := errors.New("no proof")
	if _, _, err := a.tr.KnockWith(ctx, b.tr.Addr().String(), [32]byte{}, KnockPair, func(Remote) ([]byte, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Fatalf("payload error: %v", err)
	}
	if len(served) != 2 {
		t.Fatal("a knock was served after the payload func failed")
	}
}
