// Package replication owns consensus: one go.etcd.io/raft/v3 group per
// cluster, driven by one goroutine (Node.run) that alone touches the RawNode,
// decides the log's write order and tracks every proposal.
//
// The loop follows raft's documented order for each Ready: persist the
// entries and hard state in one storage transaction, send messages, hand
// committed entries to the apply goroutine, Advance. Each turn steps every
// peer message already queued before it takes the Ready, and the master
// holds back the appends that would carry only a new commit index while
// more appends are coming (commitsend.go), so a slave under load handles
// about one message, one Ready and one answer per batch.
//
// Acks are computed here, not read off raft's commit index: an async
// proposal resolves once the entries holding it are saved on this node while
// it is the master; a sync one once MinSyncReplicas other members' Match
// covers it. A proposal that cannot meet its rule within SyncTimeout fails
// with ErrAckTimeout, so nothing is ever reported acked that is not. A sync
// record may commit before (or after) that outcome, so the master logs the
// outcome too: settlement records that confirm or abort each sync record it
// logged, and that every member applies before it delivers one (settle.go).
//
// A record proposed while another node is the master goes to it through
// the node's forward stream (forward.go): one queue in arrival order, sent
// in batches that the master proposes in the stream's order, sent again in
// that order after a master change, so each publisher's records keep their
// order in the log. A deposed master's requeue re-publishes through it too.
//
// Files: node.go holds Node, its Config and the raft loop (run);
// proposal.go the way a proposal travels to its ack rule (queue, MsgProp,
// saved, acked, expired); ready.go what each Ready does (persist, send,
// leadership, retention floor); commitsend.go the commit-only appends held
// back while appends flow; settle.go the settlement of sync records;
// apply.go the apply goroutine and membership entries; snapshot.go the
// install of a snapshot (in log order, through a Restorer applier) and
// which members hold retention; snappull.go the pull of a snapshot too
// large for raft's message, in chunks; backfill.go the pull of the records
// before an installed snapshot; forward.go the slave → master forward
// stream; handoff.go the hand-over of the mastership by a master that
// cannot write (members' disk reports on heartbeat responses); cutoff.go
// how a master finds it is cut off from the majority (and the clock of
// when each peer was last heard, which silence is counted on too);
// transport.go, link.go and handshake.go the peer TCP transport.
//
// Threading: Propose, Status and Stop may be called from any goroutine.
// Proposal callbacks run on the raft goroutine (or, for forwarded records,
// on a goroutine of the forward stream) and must not block. Applier runs on
// its own goroutine, in log order.
package replication
