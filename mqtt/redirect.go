package mqtt

import (
	"github.com/mochi-mqtt/server/v2/packets"
)

// redirection is where devices are sent while this member cannot take
// their publishes, and why.
type redirection struct{ ref, why string }

// Redirect tells the broker that this member cannot take publishes now (it
// is cut off from the cluster, has no master, or its disk is full: why says
// which, for the devices and the log) and that devices should use the member
// whose MQTT address is ref ("host:port"). Connected clients are ended: MQTT 5
// ones with DISCONNECT 0x9C (Use another server) carrying ref as the Server
// Reference, 3.1.1 ones by closing the connection, which has no way to say
// more. Until Serve, a CONNECT is answered with CONNACK 0x9C and the same
// reference (3.1.1: 0x03 Server unavailable). Sessions stay as they are:
// a persistent one resumes from its cursor on whichever member the device
// reaches. An empty ref is Serve: with no other member to name, sending
// devices away would leave them nowhere, and this member still serves
// subscribers.
func (s *Server) Redirect(ref, why string) {
	if ref == "" {
		s.Serve()
		return
	}
	r := &redirection{ref: ref, why: why}
	if old := s.redirect.Swap(r); old != nil && *old == *r {
		return // already sent away there
	}
	s.lines.Warn("sending devices to another member", "server_reference", ref, "reason", why)
	for _, c := range s.onlineConns() {
		c.endRedirected(r)
	}
}

// Refuse tells the broker that this member takes no devices now and has
// no other member to name: what it would serve them is wrong, not only
// late (its broker state is part old, part new: why says so, for the
// devices and the log). Unlike an empty Redirect, which keeps them,
// connected clients are ended: MQTT 5 ones with DISCONNECT 0x89 Server
// busy and why (0x88 Server unavailable is a CONNACK's only), 3.1.1 ones by
// closing the connection. Until Serve (or Redirect), a CONNECT is answered
// with CONNACK 0x88 Server unavailable (3.1.1: 0x03). Sessions stay as
// they are.
func (s *Server) Refuse(why string) {
	r := &redirection{why: why}
	if old := s.redirect.Swap(r); old != nil && *old == *r {
		return
	}
	s.lines.Warn("refusing devices, with no other member to send them to", "reason", why)
	for _, c := range s.onlineConns() {
		c.endRedirected(r)
	}
}

// endRedirected ends c as r says: 0x9C naming the member to use, or 0x89
// when there is none to name (Refuse).
func (c *conn) endRedirected(r *redirection) {
	if r.ref == "" {
		c.endTo(packets.ErrServerBusy, "", r.why)
		return
	}
	c.endTo(packets.ErrUseAnotherServer, r.ref, r.why)
}

// Serve ends Redirect: this member takes connections again.
func (s *Server) Serve() {
	if old := s.redirect.Swap(nil); old != nil {
		s.lines.Info("taking devices again", "was", old.why)
	}
}

// Redirecting returns the reference devices are sent to, and why; "" while
// this member serves (why alone while it refuses them: Refuse).
func (s *Server) Redirecting() (ref, why string) {
	if r := s.redirect.Load(); r != nil {
		return r.ref, r.why
	}
	return "", ""
}

// refuseTo answers a CONNECT while the member sends devices elsewhere, or
// refuses them with nowhere to send them (0x88).
func (c *conn) refuseTo(pk *packets.Packet, r *redirection) bool {
	if c.v == 5 {
		ack := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack},
			ReasonCode: packets.ErrUseAnotherServer.Code}
		if r.ref == "" {
			ack.ReasonCode = packets.ErrServerUnavailable.Code
		}
		ack.Properties.ServerReference = r.ref
		ack.Properties.ReasonString = r.why
		c.send(ack)
	} else {
		c.send(&packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack}, ReasonCode: 0x03})
	}
	if r.ref == "" {
		c.srv.refusal(c.host, "refused: "+r.why, "client", pk.Connect.ClientIdentifier, "remote", c.remote())
		return false
	}
	c.srv.refusal(c.host, "sent to another member: "+r.why, "client", pk.Connect.ClientIdentifier,
		"remote", c.remote(), "server_reference", r.ref)
	return false
}
