//go:build tandem_next

package storage

// A test build of a next release (go build -tags tandem_next; never
// shipped): it knows feature level 5, FeatureNote, which allows one more
// control record kind, KindNote. The release build reads a KindNote as a
// kind it does not know: its applier counts it in
// tandem_records_skipped_total and goes on. The e2e upgrade test
// (TestUpgradeToNextLevel) shows the new kind is written only once every
// member's build knows it.
const (
	// FeatureNote allows KindNote records.
	FeatureNote = FeatureInboundResends + 1
	// FeatureLevel is the highest level this build knows.
	FeatureLevel = FeatureNote
)

// KindNote is a control record with a line of text, written once by a
// master when the cluster's level allows it (replication/feature_next.go).
const KindNote = KindFeature + 1
