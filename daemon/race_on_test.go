//go:build race

package daemon

// raceEnabled: the race detector is on; tests that move many messages move
// fewer.
const raceEnabled = true
