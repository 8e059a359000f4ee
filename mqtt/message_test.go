package mqtt

import (
	"testing"
	"time"
)

func TestMatchTopic(t *testing.T) {
	for _, c := range []struct {
		filter, topic string
		want          bool
	}{
		{"a/b", "a/b", true},
		{"a/b", "a/c", false},
		{"a/+", "a/b", true},
		{"a/+", "a/b/c", false},
		{"a/+/c", "a/b/c", true},
		{"a/#", "a", true}, // "#" matches the parent level too
		{"a/#", "a/b/c", true},
		{"#", "a/b", true},
		{"+", "a", true},
		{"+", "a/b", false},
		{"+/+", "/b", true}, // an empty level is a level
		{"#", "$SYS/x", false},
		{"+/x", "$SYS/x", false},
		{"$SYS/#", "$SYS/x", true},
		{"a/b", "a/b/", false},
	} {
		if got := MatchTopic(c.filter, c.topic); got != c.want {
			t.Errorf("MatchTopic(%q, %q) = %v, want %v", c.filter, c.topic, got, c.want)
		}
	}
}

func TestAckForFirstMatchWins(t *testing.T) {
	rules := []TopicPolicy{{"alarms/#", Sync}, {"alarms/low/#", Async}, {"#", Async}}
	if AckFor(rules, "alarms/low/x") != Sync {
		t.Error("first matching rule must win")
	}
	if AckFor(rules, "telemetry/x") != Async || AckFor(nil, "x") != Async {
		t.Error("default must be async")
	}
	if m, err := ParseAckMode("sync"); err != nil || m != Sync || m.String() != "sync" {
		t.Error("parse sync")
	}
	if _, err := ParseAckMode("maybe"); err == nil {
		t.Error("ParseAckMode accepted maybe")
	}
}

func TestDeliveredExpiryCountsFromPublish(t *testing.T) {
	now := time.Now()
	m := &Message{Topic: "t", QoS: 1, MessageExpiry: 60, MessageExpirySet: true, Time: now.Add(-20 * time.Second).UnixNano()}
	left, live := m.expiryLeft(now)
	if !live || left != 40 {
		t.Fatalf("20 s after publish with a 60 s expiry: live %v, interval %d, want 40", live, left)
	}
	if _, live := m.expiryLeft(now.Add(41 * time.Second)); live {
		t.Fatal("delivered after its expiry")
	}
	m.MessageExpirySet, m.MessageExpiry = false, 0
	if _, live := m.expiryLeft(now.Add(time.Hour)); !live {
		t.Fatal("a message without expiry expired")
	}
}
