package replication

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// TestMembersLearnEveryCommitWithoutHeartbeats: the master holds back the
// appends that carry only a new commit index while proposals are queued
// (commitsend.go); the members must still learn every commit index from
// the appends alone. Ticks are logical here and stop once the master is
// elected, so no heartbeat ever carries a commit index: a held append that
// is never sent, or one dropped for an append that conveys less, leaves a
// member short of the last records for good.
func TestMembersLearnEveryCommitWithoutHeartbeats(t *testing.T) {
	var mu sync.Mutex
	ticks := map[uint64]chan struct{}{}
	var lead uint64
	c := newClusterWith(t, 3, func(cfg *Config) {
		mu.Lock()
		defer mu.Unlock()
		ch := make(chan struct{})
		ticks[cfg.Identity.ID] = ch
		cfg.ticks = ch
		cfg.ElectionTimeout = 10 * time.Second // 1,000 ticks: never reached
		if lead == 0 {
			lead = cfg.Identity.ID
			cfg.ElectionTimeout = 300 * time.Millisecond // 30 ticks
		}
	})
	mu.Lock()
	tick := ticks[lead]
	mu.Unlock()
	waitFor(t, "the first member to be elected master", func() bool {
		select {
		case tick <- struct{}{}:
		case <-time.After(10 * time.Millisecond):
		}
		st, err := c.nodes[lead].Status(t.Context())
		return err == nil && st.Role == "master"
	})

	// Publishers that keep a few proposals queued at once, as devices do:
	// most commit indexes then move while proposals wait.
	const publishers, each = 8, 40
	var wg sync.WaitGroup
	errs := make(chan error, publishers*each)
	for p := range publishers {
		wg.Go(func() {
			for i := range each {
				if r := wait(t, c.nodes[lead].propose(t, fmt.Sprintf("a/%d/%d", p, i), Async)); r.err != nil {
					errs <- r.err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("a proposal failed: %v", err)
	}
	for _, id := range c.ids {
		waitFor(t, fmt.Sprintf("member %s to apply all %d records", IDString(id), publishers*each), func() bool {
			return len(c.applied(id)) == publishers*each
		})
	}
}
