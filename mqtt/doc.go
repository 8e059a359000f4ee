// Package mqtt owns the embedded broker (mochi-mqtt v2): listeners, topic
// ack policies, and the two hooks that make it durable.
//
// The ingest hook turns each PUBLISH into a proposal to a Log (an interface
// declared here; the daemon plugs replication into it), tells mochi to send
// nothing, and writes the PUBACK/PUBREC itself when the Log resolves the
// proposal. So one client can pipeline many publishes while each ack still
// waits for its topic's rule. Acks leave in the order their publishes
// arrived, coalesced into one write per run; one writer goroutine per client
// at a time, so a client that stops reading stalls only itself.
//
// Committed records come back through Broker.Deliver and reach subscribers
// via an inline "shadow" client, which keeps every MQTT 5 property, retain
// and NoLocal. The persist hook mirrors sessions, subscriptions, in-flight
// messages and retained messages into a SessionStore.
//
// This package imports no other package of tandem.
package mqtt
