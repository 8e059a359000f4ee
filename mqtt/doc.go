// Package mqtt is tandem's MQTT broker: listeners (TCP, TLS, WebSocket),
// connections, sessions, subscriptions, retained messages, auth, ACLs and
// limits, for MQTT 3.1.1 and 5. It is tandem's own code on mochi-mqtt's
// packets package, the wire codec; nothing of mochi's Server is used.
//
// # Connections
//
// A connection is a read loop and one writer. The read loop decodes
// packets (mochi's codec, then wire.go for what mochi lets through: a
// property sent twice, a zero MQTT forbids, reserved bits; such a packet
// ends its connection with 0x81 or 0x82) and acts on them; it never waits
// for the log, and it never writes the socket. The writer alone writes: control packets (CONNACK,
// SUBACK, PINGRESP, PUBREL, PUBCOMP, DISCONNECT) that the read loop
// encoded, the PUBACK/PUBREC of the client's publishes in the order they
// came, and deliveries from the session, all in one write per round. It
// runs while there is something to write and ends when there is not (an
// idle connection costs one goroutine); a kick starts it again. A client
// that stops reading blocks only its own writer, which gives up after a
// write timeout.
//
// On a plain TCP socket the read loop reads once per wake-up: it handles
// what a read brought inside the socket's RawConn.Read and waits there for
// readability when that read took all there was, instead of reading again
// to learn so (readraw.go). Its read buffer comes from a pool and goes back
// whenever the socket is drained, so an idle connection holds none. A
// connection with nothing to read after CONNECT, or after a wait longer
// than a second, has no goroutine at all: its socket waits in the server's
// idler (one epoll instance and goroutine), which starts a read loop again
// on data, the keep alive deadline or an end (readpark.go).
//
// # Publishes and acks
//
// A PUBLISH is checked (topic alias, limits, ACL, receive maximum: an MQTT
// 5 client past it is disconnected with 0x93, that connection only; a
// 3.1.1 client is simply not read from until acks go out), given a record
// id, proposed to the Log with its topic's ack mode, and its ack queued.
// The Log's done callback marks the ack; the writer writes the acks at the
// head of the queue that are done. QoS 2 publishes keep their packet id in
// the session's inbound table until PUBREL, apart from the outbound ids;
// a resend (DUP) is answered with the original's outcome and not logged
// again. The inbound table is on disk, so this holds across a restart.
//
// # Sessions are cursors into the log
//
// Committed records come back in log order through Deliver (the daemon's
// applier, one goroutine). Deliver updates the retained store, looks the
// topic up in the subscription tree, merges a session's overlapping
// subscriptions into one delivery (highest QoS, every subscription
// identifier) and offers it to the session: a short append to a bounded
// queue under the session's lock, then a kick of its writer. It never
// waits for a session. A session whose queue is full, or whose client is
// offline, is "behind": its writer reads the log from its cursor (the
// index up to which it has handed everything out) through its filters, in
// batches, until it is level again: up to the last record Deliver was
// given, not the last it finished, since a record left to the replay by
// an offer is in the log before Deliver returns. So a persistent session
// holds only its cursor while its client is away, and nothing is copied.
// A record taken under a sync rule is held (hold.go): a session does not
// move past it until the master's settlement (Settle) confirms it, and
// skips it for ever when it is aborted.
//
// Session state is staged into a SessionStore (the daemon's data file,
// durable with the next log commit): the session, its subscriptions, its
// cursor (in batches: a cursor behind on disk after a crash costs QoS 1
// duplicates only), its messages in flight by log index and packet id
// (resent with DUP on resume, QoS 2 exactly once), the inbound QoS 2
// markers, and the retained messages with the index that set them.
//
// # A device that moves between members
//
// A persistent session's life is logged as small records on $tandem/
// topics (cluster.go): its start, subscriptions (the SUBACK waits for
// them), end and, every 100 ms, its cursor. Every member applies them to
// an offline copy, so a device that connects elsewhere finds its session.
// A resumed session replays the log only once its own start record is
// applied where it now is: log order makes that record a barrier behind
// everything committed before the device came, and until it is applied the
// session, though online, takes the release records other members logged
// for it as an offline copy does. QoS 2 stays exactly once
// (qos2.go): deliveries take their packet id from the record's index, so
// every member sends a message under the same id, with DUP when the device
// may hold it; the PUBREL waits for a release record another member holds
// (Replicated), so a copy never sends a finished flow again (a release that
// cannot be logged sends none: the connection ends, and the next one logs
// it first); and a copy
// keeps the inbound QoS 2 ids of the device's publishes from the log, so a
// resend after a move is not logged twice (one read before the session's
// start record is applied waits for it: awaitStart).
//
// # Devices follow the master
//
// Redirect (redirect.go) ends every connection with DISCONNECT 0x9C and a
// Server Reference (3.1.1: closes it) and answers CONNECTs with CONNACK
// 0x9C (3.1.1: 0x03) until Serve: the daemon calls it while this member
// cannot take publishes and another member may. Refuse does the same with
// no member to name (DISCONNECT 0x89, CONNACK 0x88): the daemon calls it
// while what this member would serve devices is wrong (its broker state
// is incomplete) and it knows no other member.
//
// # Threading
//
// The server's mutex guards the session map; a session's mutex guards its
// state; a connection's locks guard its ack queue and its writer state.
// Locks are taken server, then session, and a connection's one at a time;
// nothing blocks under any of them.
// The Log's callbacks only mark and kick; the daemon runs them on a
// goroutine of its own (daemon/acks.go), never replication's.
// Every goroutine the server starts is waited for by Stop.
//
// This package imports no other package of tandem: the daemon plugs
// replication in through Log, LogReader and SessionStore.
package mqtt
