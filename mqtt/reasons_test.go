package mqtt

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// Acks carry bare reason codes (DESIGN.md, "Every disconnect reaches the
// client"): the paho MQTT 5 suite's test_dollar_topics, and device stacks
// written against Mosquitto, accept only a 2–4 byte PUBACK.

// [MQTT-3.3.5-2]: a PUBLISH to a $ topic is refused with PUBACK (QoS 1) or
// PUBREC (QoS 2) 0x87 and nothing else: packet id and reason code, no
// Reason String; the server's log still says why.
func TestMQTT_3_3_5_2_DollarPublishIsAckedWithABareReasonCode(t *testing.T) {
	var lines testutil.Buffer
	s, _ := testServer(t, nil, func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&lines, nil)) })
	c := dialRaw(t, s.Addr(), 5)
	c.connect("dollar", true, nil)
	c.publish("$SYS/x", 1, 1, "no")
	ack := c.expect(packets.Puback)
	if ack.ReasonCode != packets.ErrNotAuthorized.Code || ack.FixedHeader.Remaining < 2 || ack.FixedHeader.Remaining > 4 {
		t.Fatalf("PUBACK reason %#x, %d bytes (reason string %q); want 0x87 in 2-4 bytes",
			ack.ReasonCode, ack.FixedHeader.Remaining, ack.Properties.ReasonString)
	}
	c.publish("$SYS/y", 2, 2, "no")
	rec := c.expect(packets.Pubrec)
	if rec.ReasonCode != packets.ErrNotAuthorized.Code || rec.FixedHeader.Remaining > 4 {
		t.Fatalf("PUBREC reason %#x, %d bytes, want 0x87 in 2-4 bytes", rec.ReasonCode, rec.FixedHeader.Remaining)
	}
	testutil.WaitFor(t, 5*time.Second, "the log says why", func() bool {
		return strings.Contains(lines.String(), "publish not acked") && strings.Contains(lines.String(), ErrNotAuthorized.Error())
	}, lines.String)
	// A refused publish ends nothing.
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	c.expect(packets.Pingresp)
}

// mqtt.reason_strings: all gives the acks their Reason String back, for
// clients that show it.
func TestAckReasonStringsAllAddsTheReasonString(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.AckReasonStrings = true })
	c := dialRaw(t, s.Addr(), 5)
	c.connect("dollar", true, nil)
	c.publish("$SYS/x", 1, 1, "no")
	ack := c.expect(packets.Puback)
	if ack.ReasonCode != packets.ErrNotAuthorized.Code || ack.Properties.ReasonString == "" {
		t.Fatalf("PUBACK reason %#x, reason string %q; want 0x87 with a reason string", ack.ReasonCode, ack.Properties.ReasonString)
	}
	// Request Problem Information 0 still takes it away [MQTT-3.1.2-29].
	q := dialRaw(t, s.Addr(), 5)
	var noProblem byte
	q.connect("quiet", true, &packets.Properties{RequestProblemInfo: noProblem, RequestProblemInfoFlag: true})
	q.publish("$SYS/x", 1, 1, "no")
	if ack := q.expect(packets.Puback); ack.Properties.ReasonString != "" || ack.ReasonCode != packets.ErrNotAuthorized.Code {
		t.Fatalf("PUBACK to a client that asked for no problem information: %#x %q", ack.ReasonCode, ack.Properties.ReasonString)
	}
}

// [MQTT-3.1.2-19]: with the Password Flag set a password is present, and
// a zero-length one is a password: MQTT.js sends one (and an empty user
// name) for a dashboard's empty login fields, and Mosquitto admits it.
// It was refused as a malformed CONNECT (0x81).
func TestMQTT_3_1_2_19_EmptyPasswordIsAPassword(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	for _, v := range []byte{4, 5} {
		b := append(mqttString("MQTT"), v, 0xC2, 0, 30) // user name, password, clean
		if v == 5 {
			b = append(b, propsBlock()...)
		}
		b = append(append(append(b, mqttString("empty-login")...), mqttString("")...), mqttString("")...)
		c := dialRaw(t, s.Addr(), v)
		if code := connack(t, c, testutil.MQTTFrame(packets.Connect<<4, b)); code != 0 {
			t.Fatalf("v%d CONNECT with an empty user name and password: CONNACK %#x, want 0", v, code)
		}
	}
}
