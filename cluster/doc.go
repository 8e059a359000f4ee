// Package cluster is the control plane of a gateway: which gateways form
// its cluster and how that changes. It owns the replication node in force
// (Gateway starts it, and restarts or swaps it for a join, a removal, a
// promotion or a rejoin), the peer transport's requests beside raft's
// (forwarding a slave's publishes to the master with their outcome codes,
// cluster commands, topic-rule hashes, member updates, leave notices), the
// membership details, join tokens and pairing codes, promotion and
// automatic failover, a deposed master's rejoin, and the mDNS
// advertisement and browsing that find members.
//
// It reaches the gateway around it only through Host (the config in force,
// the broker's side of a node swap, a way to give up), which the daemon
// implements; it imports replication, storage, discovery and config and
// nothing above them. The daemon and its admin endpoints use it through
// the exported methods of gatewayapi.go; Internals is for the daemon's
// integration tests only.
//
// What lives where:
//   - gateway.go, gatewayapi.go: Gateway, Host, the node in force.
//   - cluster.go: the cluster's state, peer requests, forwarding from
//     slaves with its outcome codes.
//   - keeper.go: the keeper (own details, the membership's shape) and the
//     topic-rule hashes members exchange.
//   - join.go: join tokens, invites, join and removal.
//   - pair.go: pairing codes and the pairing handshake.
//   - promote.go, rejoin.go: promotion, automatic failover, the deposed
//     master's knocks and its rejoin.
//   - mdns.go: what this gateway advertises and whom it browses for.
//
// Locks: Gateway.swapMu serialises node swaps and is held while one runs;
// the cluster's fields are guarded by the mutex their comment names (id,
// topicsMu, lingerMu, addrsMu; the invite and pairing books have their
// own). Counters and flags of the keeper's background rounds are atomics.
//
// Goroutines: every one starts through cluster.goFunc on the cluster's
// WaitGroup, which Stop waits for before it closes the transport and stops
// the node: the keeper (StartKeeper), every background round it starts and
// the probes of a failover round, and startNode's watcher, which fails the
// gateway when the node in force fails. Forwarding starts none here: it
// is replication's forward stream, carried by one transport request.
package cluster
