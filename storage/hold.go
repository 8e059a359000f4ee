package storage

import "math"

// SetHoldFloor sets a second bound on what retention may drop, besides the
// members' floor (SetRetentionFloor): the highest index a reader of the
// log that is no member still allows to go, such as the slowest uplink's
// replicated position. math.MaxUint64 holds nothing back (the default).
// Over budget with only held records left, the DB refuses, as for the
// members' floor. Raising it past where retention waits wakes a
// checkpoint.
func (db *DB) SetHoldFloor(i uint64) {
	v := i + 1 // MaxUint64 wraps to 0: nothing held
	if db.hold.Swap(v) == v || db.ro || !db.retainOn() {
		return
	}
	if b := db.blockedAt.Load(); b != 0 && i >= b {
		db.kickRetention()
	}
}

// HoldFloor is what SetHoldFloor set; math.MaxUint64 when nothing is held.
func (db *DB) HoldFloor() uint64 {
	if v := db.hold.Load(); v != 0 {
		return v - 1
	}
	return math.MaxUint64
}

// dropFloor is the highest index retention may drop: the lower of the
// members' floor and the hold.
func (db *DB) dropFloor() uint64 { return min(db.floor.Load(), db.HoldFloor()) }
