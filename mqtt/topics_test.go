package mqtt

import (
	"strings"
	"testing"
)

// TestValidTopic: a topic may be published to when it is not empty and
// holds no wildcard and no NUL, wherever they are, in any UTF-8.
func TestValidTopic(t *testing.T) {
	for _, topic := range []string{"", "a", "a/b/c", "/", "é/ü/日本", "a+", "+", "a/#", "#", "a\x00b", "\x00", "sport/+/x", "a b", "$SYS/x"} {
		want := topic != "" && !strings.ContainsAny(topic, "+#\x00")
		if got := validTopic(topic); got != want {
			t.Errorf("validTopic(%q) = %v, want %v", topic, got, want)
		}
	}
}
