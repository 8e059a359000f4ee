// Package daemon runs one gateway: it wires storage, replication, the MQTT
// broker, the control plane and the admin server together and owns their
// lifecycle. It is what `tandem run` starts (package cli); nothing else
// imports it.
//
// What lives where:
//   - daemon.go: Daemon, New, Start (data dir → storage → peer transport →
//     broker → replication node → keeper → MQTT listener → HTTP), Stop (the
//     reverse), and the node in force: startNode, restartNode (how a join,
//     a removal or a rejoin swaps the replication node under swapMu).
//   - reload.go: Reload (SIGHUP): topic rules, users and ACL files, and the
//     translation of config sections into mqtt's.
//   - adapters.go: the broker's log interface onto replication (Message ↔
//     storage.Record), the applier, the session store.
//   - admin.go, status.go, clusterapi.go: the daemon as admin.Gateway, the
//     status JSON it assembles, and the cluster endpoints it registers.
//   - cluster.go, join.go, pair.go, promote.go, rejoin.go, redeliver.go,
//     mdns.go: the control plane (keeper, join, pairing, promotion,
//     rejoin, forwarding from slaves, mDNS), due to move to cluster/.
//   - datadir.go, listenhint.go: checks and hints for the errors an
//     installer meets first (data dir, addresses in use).
//
// Locks: swapMu serialises node swaps and guards the pointer in force
// against a swap half done; reloadMu serialises Reload and guards live,
// the config in force. The cluster's own state is guarded by its locks
// (cluster.go).
//
// Goroutines: the keeper and the cluster's background rounds run on the
// cluster's WaitGroup, which Stop waits for; the admin server and the field
// view's sampler are admin's and are stopped and waited for by Stop. The
// watcher that fails the gateway when the node in force fails (startNode)
// is not yet tracked.
package daemon
