package daemon

import (
	"fmt"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// clusterHost is the daemon as the control plane's Host: the broker's
// side of a node swap.
type clusterHost struct{ d *Daemon }

func (h clusterHost) Live() *config.Config         { return h.d.liveConfig() }
func (h clusterHost) Serving() <-chan struct{}     { return h.d.apply.ready }
func (h clusterHost) MQTTAddr() string             { return h.d.broker.Addr() }
func (h clusterHost) Applier() replication.Applier { return h.d.redeliver.wrap(h.d.apply) }
func (h clusterHost) AfterResolve()                { h.d.acks.flush() }
func (h clusterHost) Fail(err error)               { h.d.fail(err) }

func (h clusterHost) Rewind(quietUntil uint64) {
	h.d.apply.quietUntil.Store(quietUntil)
	h.d.broker.Rewind(h.d.db.Applied(), quietUntil)
	h.d.ups.rewind(h.d.db.Applied())
}

func (h clusterHost) Remember(from uint64) error {
	return h.d.redeliver.remember(h.d.db, from, h.d.db.Applied())
}

// Admit refuses a forwarded record whose topic an uplink with a full
// backlog and on_full: refuse holds back, as the publish path does for
// the master's own devices.
func (h clusterHost) Admit(data []byte) error {
	kind, topic, _, err := storage.RecordHead(data)
	if err != nil || kind != storage.KindMessage || !h.d.ups.refuses(string(topic)) {
		return nil // a control record holds up no uplink
	}
	return fmt.Errorf("%w: an uplink's backlog is full (on_full: refuse)", replication.ErrStorage)
}

// PastBudget takes a resumed session's start record and the release
// records of QoS 2 deliveries while the log is over its budget: without
// them the session's device is not served on a member of a cluster (mqtt's
// proposeStart and released end its connection), and subscribers keep
// being served while publishes are refused. A start is one per CONNECT,
// which the connect rate bounds; a release covers deliveries of records
// the log holds already (mqtt.IsServingRecord).
func (h clusterHost) PastBudget(data []byte) bool {
	// By topic, not kind: below feature level 2 a session record is
	// written as a message on its $tandem/ topic, which no device may
	// publish to.
	_, topic, _, err := storage.RecordHead(data)
	if err != nil || !mqtt.IsSessionTopic(string(topic)) {
		return false
	}
	rec, err := storage.DecodeRecord(data)
	return err == nil && mqtt.IsServingRecord(rec.Topic, rec.Payload)
}
