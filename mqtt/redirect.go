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
		c.endTo(packets.ErrUseAnotherServer, ref, why)
	}
}

// Serve ends Redirect: this member takes connections again.
func (s *Server) Serve() {
	if old := s.redirect.Swap(nil); old != nil {
		s.lines.Info("taking devices again", "was", old.why)
	}
}

// Redirecting returns the reference devices are sent to, and why; "" while
// this member serves.
func (s *Server) Redirecting() (ref, why string) {
	if r := s.redirect.Load(); r != nil {
		return r.ref, r.why
	}
	return "", ""
}

// refuseTo answers a CONNECT while the member sends devices elsewhere.
func (c *conn) refuseTo(pk *packets.Packet, r *redirection) bool {
	if c.v == 5 {
		ack := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack},
			ReasonCode: packets.ErrUseAnotherServer.Code}
		ack.Properties.ServerReference = r.ref
		ack.Properties.ReasonString = r.why
		c.send(ack)
	} else {
		c.send(&packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack}, ReasonCode: 0x03})
	}
	c.srv.refusal(c.host, "sent to another member: "+r.why, "client", pk.Connect.ClientIdentifier,
		"remote", c.remote(), "server_reference", r.ref)
	return false
}
