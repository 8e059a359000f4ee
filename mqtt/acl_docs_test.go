package mqtt

import (
	"os"
	"strings"
	"testing"
)

// The example ACL file of docs/security.md is one the gateway takes: a
// newcomer copies it first (issue #34: its inline comments failed `tandem
// check`), and it grants and denies what the docs say it does.
func TestDocsExampleACLParsesAndHolds(t *testing.T) {
	b, err := os.ReadFile("../docs/security.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "**ACL file.**")
	if !ok {
		t.Fatal("docs/security.md has no **ACL file.** paragraph")
	}
	_, rest, ok = strings.Cut(rest, "```\n")
	block, _, ok2 := strings.Cut(rest, "```")
	if !ok || !ok2 {
		t.Fatal("no code block after **ACL file.**")
	}
	acl, err := ParseACL(strings.NewReader(block), "docs/security.md's ACL example")
	if err != nil {
		t.Fatalf("the example ACL of docs/security.md does not parse: %v", err)
	}
	for _, c := range []struct {
		user, client, topic string
		write, want         bool
	}{
		{"", "anon", "public/news", false, true},
		{"", "anon", "public/news", true, false},
		{"dashboard", "dash", "plant/line1/temp", false, true},
		{"dashboard", "dash", "plant/secrets/key", false, false},
		{"sensor-12", "s12", "plant/line1/temp", true, true},
		{"sensor-12", "s12", "plant/line2/temp", true, false},
		{"sensor-12", "s12", "devices/s12/status", true, true},
		{"sensor-12", "s12", "users/sensor-12/x", false, true},
	} {
		if got := acl.Allowed(c.user, c.client, c.topic, c.write); got != c.want {
			t.Errorf("user %q client %q %s %s: allowed %v, want %v", c.user, c.client, map[bool]string{true: "write", false: "read"}[c.write], c.topic, got, c.want)
		}
	}
}
