package mqtt

import (
	"encoding/binary"
	"fmt"

	"github.com/mochi-mqtt/server/v2/packets"
)

// mochi's decoder keeps the last of a property sent twice, reads a Receive
// Maximum or Maximum Packet Size of 0 as "absent", and drops the reserved
// bits of an MQTT 5 subscription options byte: what MQTT 5 calls a
// Protocol Error or a Malformed Packet would pass as a valid packet. So a
// packet mochi decoded is walked once more here, on its bytes, for what
// the struct no longer shows. The walk allocates nothing.

// propKind is how a property's value is encoded.
type propKind byte

const (
	propByte propKind = iota + 1
	propU16
	propU32
	propVarint
	propString
	propBinary
	propPair
)

// propKinds is MQTT 5's property table (section 2.2.2.2), by identifier;
// zero for an identifier MQTT 5 does not define.
var propKinds = [0x2B]propKind{
	0x01: propByte,   // Payload Format Indicator
	0x02: propU32,    // Message Expiry Interval
	0x03: propString, // Content Type
	0x08: propString, // Response Topic
	0x09: propBinary, // Correlation Data
	0x0B: propVarint, // Subscription Identifier
	0x11: propU32,    // Session Expiry Interval
	0x12: propString, // Assigned Client Identifier
	0x13: propU16,    // Server Keep Alive
	0x15: propString, // Authentication Method
	0x16: propBinary, // Authentication Data
	0x17: propByte,   // Request Problem Information
	0x18: propU32,    // Will Delay Interval
	0x19: propByte,   // Request Response Information
	0x1A: propString, // Response Information
	0x1C: propString, // Server Reference
	0x1F: propString, // Reason String
	0x21: propU16,    // Receive Maximum
	0x22: propU16,    // Topic Alias Maximum
	0x23: propU16,    // Topic Alias
	0x24: propByte,   // Maximum QoS
	0x25: propByte,   // Retain Available
	0x26: propPair,   // User Property
	0x27: propU32,    // Maximum Packet Size
	0x28: propByte,   // Wildcard Subscription Available
	0x29: propByte,   // Subscription Identifier Available
	0x2A: propByte,   // Shared Subscription Available
}

// Property identifiers the checks below name.
const (
	propSubscriptionID   = 0x0B
	propRequestProblem   = 0x17
	propRequestResponse  = 0x19
	propReceiveMaximum   = 0x21
	propUserProperty     = 0x26
	propMaximumPacketLen = 0x27
)

// wireError is a packet that mochi decoded and MQTT refuses: code is what
// an MQTT 5 client is told (0x81 or 0x82), why is for the log.
type wireError struct {
	code packets.Code
	why  string
}

func malformed(format string, a ...any) *wireError {
	return &wireError{packets.ErrMalformedPacket, fmt.Sprintf(format, a...)}
}

func protocolErr(format string, a ...any) *wireError {
	return &wireError{packets.ErrProtocolViolation, fmt.Sprintf(format, a...)}
}

// checkWire checks what mochi does not in a packet it decoded: pk is the
// decoded packet (its version, flags and fields), body its bytes after the
// fixed header. nil means nothing is wrong.
func checkWire(pk *packets.Packet, body []byte) *wireError {
	v5 := pk.ProtocolVersion == 5
	if plainPublish(pk, body, v5) {
		return nil
	}
	return walkWire(pk, body, v5)
}

// walkWire is checkWire's walk of the packet's bytes.
func walkWire(pk *packets.Packet, body []byte, v5 bool) *wireError {
	w := wireReader{b: body}
	switch pk.FixedHeader.Type {
	case packets.Connect:
		if !v5 {
			return nil
		}
		w.skipString() // protocol name
		w.skip(1)      // version
		flags := w.byte()
		w.skip(2) // keep alive
		if e := w.properties("CONNECT", connectPropertyRule); e != nil {
			return e
		}
		w.skipString() // client id
		if flags&0x04 != 0 {
			if e := w.properties("will", nil); e != nil {
				return e
			}
		}
	case packets.Publish:
		if !v5 {
			return nil
		}
		w.skipString()
		if pk.FixedHeader.Qos > 0 {
			w.skip(2)
		}
		return w.properties("PUBLISH", publishPropertyRule)
	case packets.Subscribe:
		w.skip(2)
		if v5 {
			if e := w.properties("SUBSCRIBE", subscribePropertyRule); e != nil {
				return e
			}
		}
		return w.subscriptionOptions(v5)
	case packets.Unsubscribe:
		if !v5 {
			return nil
		}
		w.skip(2)
		return w.properties("UNSUBSCRIBE", nil)
	case packets.Puback, packets.Pubrec, packets.Pubrel, packets.Pubcomp:
		if !v5 || len(body) <= 3 {
			return nil // no properties [MQTT-3.4.2-1]
		}
		w.skip(3)
		return w.properties("acknowledgement", nil)
	case packets.Disconnect, packets.Auth:
		if !v5 || len(body) <= 1 {
			return nil
		}
		w.skip(1)
		return w.properties("DISCONNECT or AUTH", nil)
	}
	return nil
}

// plainPublish reports whether body is a PUBLISH with nothing for
// checkWire to look at: MQTT 3.1.1 (no properties), or MQTT 5 with an
// empty properties block, a zero byte after the topic and packet id. It
// is what nearly every publish is, and it is checked on every publish:
// the full walk (a properties reader, a table of seen identifiers) costs
// several times more.
func plainPublish(pk *packets.Packet, body []byte, v5 bool) bool {
	if pk.FixedHeader.Type != packets.Publish {
		return false
	}
	if !v5 {
		return true
	}
	if len(body) < 2 {
		return false
	}
	off := 2 + int(binary.BigEndian.Uint16(body))
	if pk.FixedHeader.Qos > 0 {
		off += 2
	}
	return off < len(body) && body[off] == 0
}

// A propertyRule checks one property's value in a packet; the walk has
// checked its encoding and that it is not a second one.
type propertyRule func(id byte, value uint32) *wireError

// connectPropertyRule: section 3.1.2.11.
func connectPropertyRule(id byte, v uint32) *wireError {
	switch {
	case id == propReceiveMaximum && v == 0:
		return protocolErr("Receive Maximum 0") // 3.1.2.11.3
	case id == propMaximumPacketLen && v == 0:
		return protocolErr("Maximum Packet Size 0") // 3.1.2.11.4
	case (id == propRequestProblem || id == propRequestResponse) && v > 1:
		return protocolErr("property %#x is %d: 0 or 1", id, v) // 3.1.2.11.6, 3.1.2.11.7
	}
	return nil
}

// publishPropertyRule: a client's PUBLISH carries no Subscription
// Identifier [MQTT-3.3.4-6].
func publishPropertyRule(id byte, _ uint32) *wireError {
	if id == propSubscriptionID {
		return protocolErr("Subscription Identifier in a client's PUBLISH")
	}
	return nil
}

// subscribePropertyRule: section 3.8.2.1.2.
func subscribePropertyRule(id byte, v uint32) *wireError {
	if id == propSubscriptionID && v == 0 {
		return protocolErr("Subscription Identifier 0")
	}
	return nil
}

// wireReader walks a packet's bytes; running past the end sets bad.
type wireReader struct {
	b   []byte
	off int
	bad bool
}

func (w *wireReader) skip(n int) {
	if n < 0 || w.off+n > len(w.b) {
		w.bad, w.off = true, len(w.b)
		return
	}
	w.off += n
}

func (w *wireReader) byte() byte {
	if w.off >= len(w.b) {
		w.bad = true
		return 0
	}
	w.off++
	return w.b[w.off-1]
}

func (w *wireReader) u16() uint16 {
	if w.off+2 > len(w.b) {
		w.bad, w.off = true, len(w.b)
		return 0
	}
	w.off += 2
	return binary.BigEndian.Uint16(w.b[w.off-2:])
}

func (w *wireReader) u32() uint32 {
	if w.off+4 > len(w.b) {
		w.bad, w.off = true, len(w.b)
		return 0
	}
	w.off += 4
	return binary.BigEndian.Uint32(w.b[w.off-4:])
}

// skipString skips a length-prefixed string or binary field.
func (w *wireReader) skipString() { w.skip(int(w.u16())) }

// varint reads a variable byte integer of at most four bytes.
func (w *wireReader) varint() uint32 {
	var v uint32
	for i := 0; i < 4; i++ {
		b := w.byte()
		v |= uint32(b&0x7f) << (7 * i)
		if b&0x80 == 0 {
			return v
		}
	}
	w.bad = true
	return 0
}

// properties walks a properties block: each identifier MQTT 5 defines
// (mochi has checked it is one for this packet), no property but User
// Property twice (section 2.2.2.2: "It is a Protocol Error to include X
// more than once"; a server's PUBLISH may repeat Subscription Identifier,
// a client's has none), each value within the block, then rule.
func (w *wireReader) properties(where string, rule propertyRule) *wireError {
	n := int(w.varint())
	if w.bad || w.off+n > len(w.b) {
		return malformed("%s properties past the packet's end", where)
	}
	end := w.off + n
	block := wireReader{b: w.b[:end], off: w.off}
	w.off = end
	var seen [len(propKinds)]bool
	for block.off < end {
		id := block.byte()
		if int(id) >= len(propKinds) || propKinds[id] == 0 {
			return malformed("%s property %#x unknown", where, id)
		}
		if seen[id] && id != propUserProperty {
			return protocolErr("%s property %#x more than once", where, id)
		}
		seen[id] = true
		var v uint32
		switch propKinds[id] {
		case propByte:
			v = uint32(block.byte())
		case propU16:
			v = uint32(block.u16())
		case propU32:
			v = block.u32()
		case propVarint:
			v = block.varint()
		case propString, propBinary:
			block.skipString()
		case propPair:
			block.skipString()
			block.skipString()
		}
		if block.bad {
			return malformed("%s property %#x runs past the properties' end", where, id)
		}
		if rule != nil {
			if e := rule(id, v); e != nil {
				e.why = where + ": " + e.why
				return e
			}
		}
	}
	return nil
}

// subscriptionOptions checks the options byte of each filter of a
// SUBSCRIBE: reserved bits clear (MQTT 5 bits 6-7 [MQTT-3.8.3-5]; 3.1.1
// bits 2-7 [MQTT-3-8.3-4]), QoS not 3, and (MQTT 5) Retain Handling not 3,
// a Protocol Error (section 3.8.3.1).
func (w *wireReader) subscriptionOptions(v5 bool) *wireError {
	reserved := byte(0xFC)
	if v5 {
		reserved = 0xC0
	}
	for w.off < len(w.b) {
		w.skipString()
		o := w.byte()
		switch {
		case w.bad:
			return malformed("SUBSCRIBE filter runs past the packet's end")
		case o&reserved != 0:
			return malformed("SUBSCRIBE options %#02x: reserved bits set", o)
		case o&3 == 3:
			return malformed("SUBSCRIBE options %#02x: QoS 3", o)
		case v5 && o>>4&3 == 3:
			return protocolErr("SUBSCRIBE options %#02x: Retain Handling 3", o)
		}
	}
	return nil
}
