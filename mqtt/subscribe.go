package mqtt

import (
	"slices"

	"github.com/mochi-mqtt/server/v2/packets"
)

// subscribe answers a SUBSCRIBE: each filter is granted or refused on its
// own; granted ones are durable before the SUBACK (a device told it is
// subscribed stays subscribed across a crash), and the retained messages
// they match follow it, once per distinct filter: a filter named again in
// the same packet replaces the earlier subscription [MQTT-3.8.4-3] and
// the packet counts as a sequence of SUBSCRIBEs [MQTT-3.8.4-4], so the
// retained messages the earlier one was owed, not yet sent, are what the
// later one re-sends [MQTT-3.3.1-9] — with the last options. They go
// through the session's bounded queue and window (outbudget.go), never in
// one burst. False ends the loop.
func (c *conn) subscribe(pk *packets.Packet) bool {
	if code := pk.SubscribeValidate(); code != packets.CodeSuccess {
		c.protocolError(code, "invalid SUBSCRIBE: "+code.Reason) // [MQTT-3.8.3-3] [MQTT-3.8.1-1]
		return false
	}
	srv := c.srv
	s := c.sess
	acl := srv.access.Load().ACL
	codes := make([]byte, len(pk.Filters))
	var owed []*retainedOwed // subscriptions owed their retained messages
	granted := false
	var records []sessionOp // a persistent session's new subscriptions, for the other members
	for i, f := range pk.Filters {
		refuse := func(code5 packets.Code, why string) {
			srv.refusal(c.id, why+": subscription refused", "client", c.id, "filter", truncate(f.Filter))
			codes[i] = code5.Code
			if c.v != 5 {
				codes[i] = 0x80 // 3.1.1 has one failure code [MQTT-3.9.3-2]
			}
		}
		group, match, shared, ok := parseShare(f.Filter)
		switch {
		case !ok || !validFilter(match):
			refuse(packets.ErrTopicFilterInvalid, "topic filter invalid")
			continue
		case srv.cfg.Limits.topicProblem(f.Filter) != "":
			refuse(packets.ErrTopicFilterInvalid, srv.cfg.Limits.topicProblem(f.Filter))
			continue
		case shared && f.NoLocal:
			c.protocolError(packets.ErrProtocolViolation, "no local on a shared subscription") // [MQTT-3.8.3-4]
			return false
		case isControl(match):
			refuse(packets.ErrNotAuthorized, "the cluster's own topics cannot be subscribed to")
			continue
		case !acl.Allowed(c.user, c.id, match, false):
			refuse(packets.ErrNotAuthorized, "read denied by ACL")
			continue
		}
		sub := &subscription{filter: f.Filter, match: match, group: group, qos: min(f.Qos, 2),
			noLocal: f.NoLocal, rap: f.RetainAsPublished, rh: f.RetainHandling, id: f.Identifier,
			since: srv.applied.Load()}
		if c.v != 5 {
			sub.noLocal, sub.rap, sub.rh, sub.id = false, false, 0, 0
		}
		s.mu.Lock()
		prev := s.subs[f.Filter]
		if prev == nil && len(s.subs) >= srv.cfg.Limits.MaxFiltersPerSession {
			s.mu.Unlock()
			refuse(packets.ErrQuotaExceeded, "max_filters_per_session reached")
			continue
		}
		if prev == nil && s.persistent() && !srv.sessionRoom(subRecCount(c.id, f.Filter, srv.pageCounts.Load()), 0) {
			s.mu.Unlock()
			refuse(packets.ErrQuotaExceeded, whySessionSubBytes)
			continue
		}
		if prev != nil {
			// The same filter subscribed again (a client resuming its
			// session does): what it matched meanwhile is still owed.
			sub.since = prev.since
		}
		s.subs[f.Filter] = sub // [MQTT-3.8.4-3]: replaces one with the same filter
		s.namedLocked(f.Filter)
		srv.recountLocked(s)
		persist := s.persistent()
		s.mu.Unlock()
		srv.index.add(s, sub)
		if persist {
			srv.saveSub(c.id, sub)
			records = append(records, sessionOp{Op: "sub", Filter: sub.filter, QoS: sub.qos, NL: sub.noLocal, RAP: sub.rap, RH: sub.rh, ID: sub.id})
		}
		codes[i] = sub.qos
		granted = true
		// Retained messages: always (0), only for a new subscription
		// (1), never (2) [MQTT-3.3.1-9] [MQTT-3.3.1-10] [MQTT-3.3.1-11];
		// none for a shared subscription [MQTT-4.8.2-?].
		if shared || sub.rh == 2 || (sub.rh == 1 && prev != nil) {
			continue
		}
		owed = append(owed, &retainedOwed{filter: f.Filter, match: match})
	}
	// Once per distinct filter, where it was last named; the retained store
	// is read then, and the options (QoS, no local, identifier) are the
	// subscription's when each message is queued.
	owed = lastOfEach(owed)
	for _, o := range owed {
		for _, r := range srv.retained.matching(o.match) {
			o.msgs = append(o.msgs, r.m)
		}
	}
	if granted && s.persistent() && srv.store != nil {
		if err := srv.store.Sync(); err != nil {
			srv.lines.Error("saving subscriptions failed", "client", c.id, "error", err)
		}
	}
	suback := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Suback}, PacketID: pk.PacketID, ReasonCodes: codes}
	srv.proposeSessionOps(c.id, records, func() {
		s.owe(owed) // before the SUBACK can be written (owe)
		c.send(suback)
	})
	return true
}

// unsubscribe answers an UNSUBSCRIBE. False ends the loop.
func (c *conn) unsubscribe(pk *packets.Packet) bool {
	if code := pk.UnsubscribeValidate(); code != packets.CodeSuccess {
		c.protocolError(code, "invalid UNSUBSCRIBE: "+code.Reason)
		return false
	}
	s := c.sess
	codes := make([]byte, len(pk.Filters))
	var records []sessionOp
	for i, f := range pk.Filters {
		s.mu.Lock()
		sub := s.subs[f.Filter]
		delete(s.subs, f.Filter)
		s.namedLocked(f.Filter)
		c.srv.recountLocked(s)
		persist := s.persistent()
		s.mu.Unlock()
		if sub == nil {
			codes[i] = packets.CodeNoSubscriptionExisted.Code
			continue
		}
		c.srv.index.remove(s, sub)
		if persist {
			c.srv.stageDelete(subKey(c.id, f.Filter))
			records = append(records, sessionOp{Op: "unsub", Filter: f.Filter})
		}
	}
	ack := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsuback}, PacketID: pk.PacketID}
	if c.v == 5 {
		ack.ReasonCodes = codes
	}
	c.srv.proposeSessionOps(c.id, records, func() { c.send(ack) })
	return true
}

// lastOfEach keeps, of entries for the same filter, the last one, in the
// order of the ones kept.
func lastOfEach(owed []*retainedOwed) []*retainedOwed {
	seen := make(map[string]bool, len(owed))
	out := owed[:0:0]
	for i := len(owed) - 1; i >= 0; i-- {
		if !seen[owed[i].filter] {
			seen[owed[i].filter] = true
			out = append(out, owed[i])
		}
	}
	slices.Reverse(out)
	return out
}
