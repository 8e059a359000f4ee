package storage

import (
	"math"
	"strings"
	"testing"
	"time"
)

// An uplink's position holds the log as a member's floor does: nothing
// past it goes, and retention resumes once it moves.
func TestRetentionNeverDropsAboveHold(t *testing.T) { forFormats(t, testRetentionNeverDropsAboveHold) }

func testRetentionNeverDropsAboveHold(t *testing.T, seg bool) {
	const budget = 8 << 20
	db := testOpen(t, t.TempDir(), &Options{MaxBytes: budget, segmented: seg})
	db.SetRetentionFloor(math.MaxUint64) // every member holds everything
	const hold = 1000
	db.SetHoldFloor(hold)
	fillPastBudget(t, db, budget)
	firstIndex := func() uint64 { f, _ := db.FirstIndex(); return f }
	if f := firstIndex(); f > hold+1 {
		t.Fatalf("FirstIndex %d: dropped past the hold %d", f, hold)
	}
	if !db.Refusing() {
		t.Errorf("over budget with the hold keeping the log: Refusing() is false")
	}
	// What refuses is said: the uplink, not a member (issue #32: a master
	// with every member live said a member lacked its records).
	if why := db.RefusingReason(); !strings.Contains(why, "uplink") || strings.Contains(why, "member") {
		t.Errorf("refusing for the hold: reason %q, want it to name the uplink", why)
	}
	db.SetHoldFloor(math.MaxUint64)
	if db.HoldFloor() != math.MaxUint64 {
		t.Fatalf("HoldFloor = %d after releasing it", db.HoldFloor())
	}
	deadline := time.Now().Add(10 * time.Second)
	for db.Refusing() || firstIndex() <= hold+1 {
		if time.Now().After(deadline) {
			t.Fatalf("after the hold was released: first index %d, refusing %v", firstIndex(), db.Refusing())
		}
		time.Sleep(5 * time.Millisecond)
	}
	checkCompactedBelow(t, db)
}
