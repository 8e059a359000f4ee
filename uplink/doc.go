// Package uplink forwards the committed log to cloud MQTT brokers and
// brings their downlink in: tandem's store-and-forward bridge.
//
// # What it owns
//
// An Uplink is one cloud broker (Config). It is a reader of the log, like
// a persistent session: it holds a position, the highest index up to which
// every record is dealt with (acked by the cloud, dropped by drop_oldest,
// or not one of its topics), and reads forward from there through the Log
// interface. Records go up in log order on one connection with at most
// max_inflight awaiting their ack, so per-publisher order holds. MQTT 5
// (eclipse/paho.golang) is the default, and each message carries the user
// property tandem-id (the record id, origin-seq) so that a consumer can
// drop duplicates; protocol 3.1.1 (eclipse/paho.mqtt.golang) is there for
// clouds that speak nothing newer, and cannot carry it. Topics under
// $tandem/ (the cluster's own records) never go up, nor what the uplink's
// own downlink brought in (its local_prefix): no loops.
//
// # Durability
//
// The position moves only over acked records, and is handed to a
// PositionSink at most every SaveEvery or SaveAcks acks (and at Stop). The
// daemon replicates it through the log and passes the last one to Start on
// the next master, so a restart or failover sends again only what was
// acked after the last saved position: the cloud's duplicates. A
// connection that drops loses its in-flight window; the next one starts
// again from the position. A refusal by the cloud (reason >= 0x80) is not
// an ack: the connection is dropped and the record retried after the
// backoff. Nothing is skipped but by drop_oldest (counted in Dropped) or by
// the log's retention overtaking the position (counted in Lost; the
// daemon's retention floor is there to prevent it).
//
// Downlink messages are handed to a LocalPublisher, and acked at the cloud
// only once that returns nil (the local ack rule met); a failure leaves
// the message unacked and drops the connection, so the cloud sends it
// again. With a downlink the cloud session is kept (SessionExpiry), so
// messages sent while the link is down wait there.
//
// # Threading
//
// Start launches two goroutines (the connection loop and housekeeping);
// each connection adds a sender, an acker and a stop watcher, all waited
// for before the connection loop goes on, and an MQTT 5 connection the
// flusher of its batchConn, which its Close waits for (at most a second
// on a stalled link); Stop waits for everything.
// Notify, Refuses, Full, Status, Counters, Pause and Resume may be called
// from any goroutine and never block on the network; Notify is meant for
// the applier and only takes a mutex. The Log and PositionSink are called
// from the uplink's goroutines, never under its mutex; but the callbacks
// it passes to Log.Committed take that mutex, so a Log must not run them
// while holding a lock that the goroutine calling Notify may wait for.
//
// This package imports no other package of tandem: the daemon plugs the
// log, the position records and the local publish path in through Log,
// PositionSink and LocalPublisher.
package uplink
