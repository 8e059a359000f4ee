package mqtt

import (
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
)

type nopLog struct{}

func (nopLog) Reserve(*Message)                                {}
func (nopLog) Propose(_ *Message, _ AckMode, done func(error)) { done(nil) }
func (nopLog) Logged(uint64, []uint64) (map[uint64]bool, error) {
	return nil, nil
}

// TestRouteCacheSeesNewSubscriptions: a topic remembered without
// subscribers is scanned again once a subscription is made, and a topic
// with subscribers stays routed.
func TestRouteCacheSeesNewSubscriptions(t *testing.T) {
	b, err := New(Config{Listen: "127.0.0.1:0"}, nopLog{})
	if err != nil {
		t.Fatal(err)
	}
	unrouted := func(topic string) bool {
		b.shadowMu.Lock()
		defer b.shadowMu.Unlock()
		return b.unroutedLocked([]byte(topic))
	}
	if !unrouted("plant/a") || !unrouted("plant/a") {
		t.Fatal("no subscriber, yet routed")
	}
	b.srv.Topics.Subscribe("c1", packets.Subscription{Filter: "plant/#", Qos: 1})
	b.subscribed()
	if unrouted("plant/a") {
		t.Fatal("a subscription made after the topic was remembered is not seen")
	}
	b.srv.Topics.Subscribe("c2", packets.Subscription{Filter: "$share/g/other/+"})
	b.subscribed()
	if unrouted("other/x") {
		t.Fatal("a shared subscription is not seen")
	}
	if !unrouted("third/x") {
		t.Fatal("unmatched topic routed")
	}
}
