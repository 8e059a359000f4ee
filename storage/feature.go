package storage

import (
	"fmt"

	bolt "go.etcd.io/bbolt"
)

// BucketFeature holds the cluster's feature level (key "level", one
// byte): the record kinds and formats every member of the cluster knows,
// raised by the master once every member's build does (DESIGN.md,
// "Versions and upgrades"). Replication stages it as the raising record
// applies; a snapshot carries it, and a reset of the raft state (a join)
// wipes it, since the level belongs to the cluster whose log this is.
const BucketFeature = "feature"

var keyFeatureLevel = "level"

// FeatureLevelOf reads the cluster's feature level as this data dir holds
// it: FeatureBase when none was ever raised.
func (db *DB) FeatureLevelOf() int {
	level := FeatureBase
	_ = db.ForEach(BucketFeature, keyFeatureLevel, func(k, v []byte) error {
		if string(k) == keyFeatureLevel && len(v) == 1 && int(v[0]) > level {
			level = int(v[0])
		}
		return nil
	})
	return level
}

// StageFeatureLevel stages the cluster's feature level, to commit with
// the log that raised it.
func (db *DB) StageFeatureLevel(level int) {
	db.Stage(BucketFeature, keyFeatureLevel, []byte{byte(level)})
}

// isFeatureRecord reports whether b is a KindFeature record.
func isFeatureRecord(b []byte) bool {
	if len(b) <= offKind || b[offVersion] != RecordVersionControl {
		return false
	}
	kind, _, _, err := RecordHead(b)
	return err == nil && kind == KindFeature
}

// checkFeatureLevel refuses a data dir whose cluster runs a feature level
// this build does not know: its log may hold records this build cannot
// read, and nothing is changed in it.
func checkFeatureLevel(tx *bolt.Tx) error {
	b := tx.Bucket([]byte(BucketFeature))
	if b == nil {
		return nil
	}
	if v := b.Get([]byte(keyFeatureLevel)); len(v) == 1 && int(v[0]) > FeatureLevel {
		return fmt.Errorf("this data dir's cluster runs at feature level %d, this build knows levels up to %d: run the release the cluster runs (or newer); the files are left as they are: %w", v[0], FeatureLevel, ErrUnknownVersion)
	}
	return nil
}
