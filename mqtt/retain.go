package mqtt

import (
	"sync/atomic"
	"time"
)

// Retain applies a committed record to the retained store only, without
// delivering it to anyone: how a gateway that joins a cluster catches up on
// the cluster's history, whose retained messages it must hold but whose old
// publishes its subscribers never asked for.
func (b *Broker) Retain(m *Message) {
	if !m.Retain {
		return
	}
	pk, live := m.packet(time.Now())
	if !live {
		return
	}
	out := pk.Copy(false)
	r := b.srv.Topics.RetainMessage(out)
	b.persist.OnRetainMessage(nil, pk, r)
	atomic.StoreInt64(&b.srv.Info.Retained, int64(b.srv.Topics.Retained.Len()))
}
