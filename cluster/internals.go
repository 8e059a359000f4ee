package cluster

import (
	"context"
	"time"

	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// Internals reaches into the control plane for the daemon's integration
// tests, which need a whole gateway (broker, storage, admin API) and so
// cannot live in this package: a stranger attacking the pairing, a deposed
// master's rejoin knocks, failover rounds on a silence made up. Nothing but
// those tests calls it.
type Internals struct{ d *Gateway }

// Internals: see the type.
func (d *Gateway) Internals() Internals { return Internals{d} }

// PendingInvites is the number of join tokens issued and not yet used up.
func (i Internals) PendingInvites() int {
	b := i.d.cl.invites
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.list)
}

// SetPairClock replaces the pairing book's clock.
func (i Internals) SetPairClock(now func() time.Time) {
	p := &i.d.cl.invites.pair
	p.mu.Lock()
	p.clock = now
	p.mu.Unlock()
}

// OnPair answers a pairing request as from the peer r.
func (i Internals) OnPair(ctx context.Context, r replication.Remote, payload []byte) ([]byte, error) {
	return i.d.cl.onPair(ctx, r, payload)
}

// AdmitRejoin answers a deposed master's rejoin knock as from the peer r.
func (i Internals) AdmitRejoin(ctx context.Context, r replication.Remote, req JoinRequest) (JoinReply, error) {
	return i.d.cl.admitRejoin(ctx, r, req)
}

// DeposedRecord is what this node recorded of its own deposition.
func (i Internals) DeposedRecord() (old replication.Member, fork uint64, ok bool, err error) {
	return i.d.cl.deposedRecord()
}

// SetLastHeard pretends the master was last heard from at t.
func (i Internals) SetLastHeard(t time.Time) {
	i.d.cl.failover.heard.Store(int64(clock.Mono() - time.Since(t)))
}

// FailoverSilence is how long the master has not been heard from.
func (i Internals) FailoverSilence() time.Duration { return i.d.cl.failover.silence() }

// FailoverRound runs one round of automatic failover against master.
func (i Internals) FailoverRound(master replication.Member, after time.Duration) bool {
	return i.d.cl.failoverRound(master, after)
}

// Superseded records that the cluster moved on to generation gen.
func (i Internals) Superseded(gen uint64, source string) { i.d.cl.superseded(gen, source) }

// SupersededGen is the generation this master learned it was superseded
// by, 0 when it was not.
func (i Internals) SupersededGen() uint64 { return i.d.cl.supersededGen() }

// SetMeta writes the cluster id and generation to db.
func (i Internals) SetMeta(db *storage.DB, id string, gen uint64) error {
	return i.d.cl.setMeta(db, id, gen)
}
