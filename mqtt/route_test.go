package mqtt

import "testing"

// TestRouteCacheSeesNewSubscriptions: a topic remembered without
// subscribers is looked up again once a subscription is made, and a topic
// with subscribers stays routed; shared subscriptions count.
func TestRouteCacheSeesNewSubscriptions(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	unrouted := func(topic string) bool { return s.Unrouted([]byte(topic)) }
	if !unrouted("plant/a") || !unrouted("plant/a") {
		t.Fatal("no subscriber, yet routed")
	}
	se := newSession(s, "c1")
	s.index.add(se, &subscription{filter: "plant/#", match: "plant/#", qos: 1})
	if unrouted("plant/a") {
		t.Fatal("a subscription made after the topic was remembered is not seen")
	}
	s.index.add(se, &subscription{filter: "$share/g/other/+", match: "other/+", group: "g"})
	if unrouted("other/x") {
		t.Fatal("a shared subscription is not seen")
	}
	if !unrouted("third/x") {
		t.Fatal("unmatched topic routed")
	}
	s.index.add(se, &subscription{filter: "#", match: "#"})
	if unrouted("third/x") || !unrouted("$SYS/x") {
		t.Fatal("a wildcard at the first level matched a $ topic")
	}
}
