//go:build !tandem_next

package replication

import "time"

// peerProtocolMax is the highest peer protocol version this build speaks
// (frame.go).
const peerProtocolMax = 1

// levelExtras is what a node keeps for the levels above the release's a
// tandem_next test build knows (feature_next.go): nothing in a release.
type levelExtras struct{}

// levelWork is what a master does with a level above the release's:
// nothing in a release build.
func (n *Node) levelWork(time.Time) {}
