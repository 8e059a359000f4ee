package mqtt

import mochi "github.com/mochi-mqtt/server/v2"

// canPublish reports whether cl may publish to topic. The ingest hook asks
// it for every PUBLISH, so a refusal is acked in order with the others.
// Users and ACLs arrive with the security issue; until then everything is
// allowed.
func (b *Broker) canPublish(cl *mochi.Client, topic string) bool { return true }
