// Package daemon runs one gateway: it wires storage, replication, the MQTT
// broker, the control plane and the admin server together and owns their
// lifecycle. It is what `tandem run` starts (package cli); nothing else
// imports it.
//
// What lives where:
//   - daemon.go: Daemon, New, Start (data dir → storage → the control
//     plane and its peer transport → broker → replication node → keeper →
//     MQTT listener → HTTP) and Stop (the reverse).
//   - clusterhost.go: the daemon as cluster.Host, the broker's side of
//     the node swaps the control plane makes (package cluster).
//   - reload.go: Reload (SIGHUP): topic rules, users and ACL files, and the
//     translation of config sections into mqtt's.
//   - adapters.go: the broker's log interface onto replication (Message ↔
//     storage.Record), the applier, the session store.
//   - acks.go: the queue that carries proposal outcomes from replication's
//     goroutine to the broker, so the raft goroutine never runs broker code
//     (deliveries reach the broker on replication's apply goroutine).
//   - serving.go: whether the gateway takes publishes (/healthz), devices
//     sent to another member while it cannot, and which members are down
//     since when (status).
//   - check.go: the validation `tandem run` and `tandem check` share (the
//     config's rules, then the users, ACL, TLS, token and uplink files it
//     names), every error at once.
//   - logapi.go: POST /v1/log, `tandem inspect` of the running gateway.
//   - admin.go, status.go, clusterapi.go: the daemon as admin.Gateway and
//     admin.Cluster, and the status JSON it assembles.
//   - redeliver.go: what a deposed master's subscribers already got, so
//     that its rejoin does not deliver it twice.
//   - uplinks.go: the cloud uplinks (package uplink) plugged in: the log
//     they read, their replicated positions ($tandem/uplinks records, kept
//     by every member in the data file), the retention hold, the refusal
//     of publishes while a backlog is full, the downlink's local publish
//     path, and the role watcher that runs them only on the master.
//   - datadir.go, listenhint.go: checks and hints for the errors an
//     installer meets first (data dir, addresses in use).
//
// Locks: reloadMu serialises Reload and guards live, the config in force;
// node swaps are the control plane's (cluster.Gateway).
//
// Goroutines: three of its own, each ended and waited for by Stop: the
// uplinks' role watcher (uplinks.go; then the uplinks stop, each saving
// its position while replication still runs), the serving watch
// (serving.go) and the ack queue (acks.go, stopped after replication, so
// the last outcomes reach the broker). Stop then stops and waits
// for those of the admin server and its field view (admin), of the
// control plane (cluster) and of the broker (mqtt), in the reverse of the
// start order.
package daemon
