package mqtt

import (
	"strings"
	"testing"
)

const testACL = `# anonymous clients
topic read public/#

user alice
topic readwrite alice/#
topic deny alice/secret
topic write shared/in
topic read shared/+/out

user bob
topic read alice/news
topic $SYS/broker/uptime

pattern write devices/%c/status
pattern read users/%u/#
pattern deny users/%u/locked
`

func TestACLMosquittoSemantics(t *testing.T) {
	a, err := ParseACL(strings.NewReader(testACL), "acl")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		user, client, topic string
		write, want         bool
	}{
		// Anonymous: the lines before the first user, and patterns.
		{"", "c1", "public/a", false, true},
		{"", "c1", "public/a", true, false},
		{"", "c1", "alice/x", false, false},
		{"", "dev1", "devices/dev1/status", true, true},
		{"", "dev1", "devices/dev2/status", true, false},
		{"", "dev1", "users//x", false, false}, // %u needs a user name
		// A user gets its section, not the anonymous one.
		{"alice", "c", "public/a", false, false},
		{"alice", "c", "alice/a/b", true, true},
		{"alice", "c", "alice", false, true}, // "alice/#" covers its parent level
		{"alice", "c", "alice/secret", false, false},
		{"alice", "c", "alice/secret", true, false},
		{"alice", "c", "shared/in", true, true},
		{"alice", "c", "shared/in", false, false}, // write only
		{"alice", "c", "shared/x/out", false, true},
		{"alice", "c", "shared/x/out", true, false},
		{"alice", "c", "users/alice/inbox", false, true},
		{"alice", "c", "users/alice/locked", false, false},
		{"alice", "c", "users/bob/inbox", false, false},
		// No access word: readwrite. '#' does not cover '$' topics.
		{"bob", "c", "$SYS/broker/uptime", true, true},
		{"bob", "c", "alice/news", false, true},
		{"bob", "c", "alice/news", true, false},
		// A user the file does not name: patterns only.
		{"carol", "c", "users/carol/x", false, true},
		{"carol", "c", "public/a", false, false},
		// Subscriptions: the filter must lie within what is granted.
		{"alice", "c", "alice/+/b", false, true},
		{"alice", "c", "alice/#", false, true},
		{"alice", "c", "#", false, false},
		{"alice", "c", "+/a", false, false},
		{"alice", "c", "shared/+/out", false, true},
		{"alice", "c", "shared/#", false, false},
		{"", "c", "public/+/x", false, true},
		{"", "c", "$SYS/#", false, false},
		// Names that would turn a pattern into a wildcard are refused.
		{"", "dev+", "devices/dev+/status", true, false},
		{"a#", "c", "users/a#/x", false, false},
	}
	for _, tt := range tests {
		if got := a.Allowed(tt.user, tt.client, tt.topic, tt.write); got != tt.want {
			t.Errorf("Allowed(user %q, client %q, %q, write=%v) = %v, want %v", tt.user, tt.client, tt.topic, tt.write, got, tt.want)
		}
	}
	var none *ACL
	if !none.Allowed("", "c", "anything", true) {
		t.Error("no ACL file must allow everything")
	}
}

func TestACLParseErrorsNameTheLine(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"topic read\n", "acl:1: topic: missing topic filter after \"read\""},
		{"\n# c\nuser\n", "acl:3: user: empty user name"},
		{"topic a/#/b\n", "acl:1: topic: \"a/#/b\": '#' must be the whole last level"},
		{"pattern write a+/b\n", "acl:1: pattern: \"a+/b\": '+' must be a whole level"},
		{"user x\ntopics read a\n", "acl:2: unknown keyword \"topics\""},
		{"topic\n", "acl:1: topic: missing topic filter"},
	} {
		_, err := ParseACL(strings.NewReader(tt.in), "acl")
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want %q", tt.in, err, tt.want)
		}
	}
	// A filter with spaces, after an access word, as Mosquitto allows.
	a, err := ParseACL(strings.NewReader("topic read room 1/temp\n"), "acl")
	if err != nil || !a.Allowed("", "c", "room 1/temp", false) {
		t.Fatalf("filter with a space: %v", err)
	}
}

func TestCoversMatchesMatchTopicOnTopics(t *testing.T) {
	filters := []string{"#", "+", "a/#", "a/+", "a/+/c", "+/b/#", "a", "a/b", "$SYS/#", "+/+"}
	topics := []string{"a", "a/b", "a/b/c", "b", "/", "a/", "$SYS/x", "x/b/y", ""}
	for _, f := range filters {
		for _, tp := range topics {
			if covers(f, tp) != MatchTopic(f, tp) {
				t.Errorf("covers(%q, %q) = %v, MatchTopic says %v", f, tp, covers(f, tp), MatchTopic(f, tp))
			}
		}
	}
}

func FuzzACLCovers(f *testing.F) {
	for _, s := range [][2]string{{"a/#", "a/+/b"}, {"+/b", "a/b"}, {"#", "$x"}, {"a/+", "a/#"}} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, acl, sub string) {
		if ValidFilter(acl) != nil || ValidFilter(sub) != nil {
			return
		}
		if !covers(acl, sub) {
			return
		}
		// Whatever sub matches, acl must match: try sub's own topic
		// instances with the wildcards filled in.
		for _, fill := range []string{"x", "", "$y"} {
			topic := strings.NewReplacer("+", fill, "#", fill+"/z").Replace(sub)
			if strings.HasPrefix(topic, "$") && !strings.HasPrefix(sub, "$") {
				continue // sub's first-level wildcard does not match it
			}
			if MatchTopic(sub, topic) && !MatchTopic(acl, topic) {
				t.Fatalf("covers(%q, %q) but %q matches only the latter", acl, sub, topic)
			}
		}
	})
}
