package replication

import (
	"testing"
	"time"
)

// TestGroupCommitWaitsForPopulation: a population seen once is waited for,
// at most the wait bound, after which the estimate drops to what came back;
// a lone publisher never waits.
func TestGroupCommitWaitsForPopulation(t *testing.T) {
	var g groupCommit
	woken := make(chan struct{}, 8)
	wake := func() { woken <- struct{}{} }
	now := time.Now()
	arrive := func(n int) {
		for i := range n {
			g.arrived(i + 1)
		}
	}
	leave := func(n int) {
		for range n {
			g.left()
		}
	}

	// A lone client: taken at once.
	arrive(1)
	if !g.take(now, true, wake) {
		t.Fatal("first proposal of a population of one was not taken")
	}
	leave(1)
	arrive(1)
	if !g.take(now, true, wake) {
		t.Fatal("population of one waited")
	}
	leave(1)

	// Ten arrive together (a new population): taken, and remembered.
	arrive(10)
	if !g.take(now, true, wake) {
		t.Fatal("ten in the node, not taken")
	}
	leave(10)
	// Three come back: wait for the rest.
	arrive(3)
	if g.take(now, true, wake) {
		t.Fatal("took 3 of a population of 10")
	}
	// The rest come back: the last one wakes the loop, and all are taken.
	for i := 4; i <= 10; i++ {
		if g.arrived(i) != (i == 10) {
			t.Fatalf("arrival %d: wake-up %v", i, i != 10)
		}
	}
	if !g.take(now.Add(time.Microsecond), true, wake) {
		t.Fatal("population back, not taken")
	}
	leave(10)

	// Only two come back: the wait ends at its bound, with a wake-up.
	arrive(2)
	if g.take(now, true, wake) {
		t.Fatal("took 2 of 10")
	}
	select {
	case <-woken:
	case <-time.After(time.Second):
		t.Fatal("no wake-up at the end of the wait")
	}
	if !g.take(now.Add(maxBatchWait), true, wake) {
		t.Fatal("not taken after the wait bound")
	}
	// The estimate moved half way down (10 -> 6); waits that keep ending
	// at their bound bring it down to the two that remain.
	if g.peak != 6 {
		t.Fatalf("estimate %d after a wait for 10 that saw 2, want 6", g.peak)
	}
	for range 8 {
		if g.peak == 2 {
			break
		}
		leave(2)
		arrive(2)
		now = now.Add(time.Second)
		if g.take(now, true, wake) {
			t.Fatalf("took 2 of an estimated %d at once", g.peak)
		}
		if !g.take(now.Add(maxBatchWait), true, wake) {
			t.Fatal("not taken after the wait bound")
		}
	}
	leave(2)
	arrive(2)
	if g.peak != 2 || !g.take(now.Add(time.Hour), true, wake) {
		t.Fatalf("the estimate (%d) did not come down to the two that came back", g.peak)
	}

	// Not leader: taken at once (refused there).
	leave(2)
	g.peak = 100
	g.target.Store(100)
	arrive(1)
	if !g.take(now, false, wake) {
		t.Fatal("a follower waited")
	}
}
