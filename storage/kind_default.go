//go:build !tandem_next

package storage

// FeatureLevel is the highest feature level this build knows. A
// tandem_next test build knows one more (kind_next.go), to prove the
// gating of a new record kind before a real one needs it.
const FeatureLevel = FeatureInboundResends
