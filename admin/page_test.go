package admin

import (
	"testing"

	"github.com/tandem-edge/tandem/config"
)

// The status page's "everything else" row is the default for topics no
// rule matches; behind a "#" rule there are none, so it is left out.
func TestTopicRowsLeaveOutTheDefaultBehindACatchAll(t *testing.T) {
	names := func(rows []topicRow) (out []string) {
		for _, r := range rows {
			out = append(out, r.Filter)
		}
		return out
	}
	some := &config.Config{Topics: []config.TopicRule{{Match: "s/#", Ack: "sync"}, {Match: "telemetry/+"}}}
	if got := names(mustRows(topicRows(some, nil))); len(got) != 3 || got[2] != "everything else" {
		t.Errorf("rules without #: rows %v", got)
	}
	all := &config.Config{Topics: []config.TopicRule{{Match: "s/#", Ack: "sync"}, {Match: "#"}}}
	if got := names(mustRows(topicRows(all, nil))); len(got) != 2 || got[1] != "#" {
		t.Errorf("rules ending in #: rows %v, want no everything-else row", got)
	}
	if got := names(mustRows(topicRows(nil, nil))); len(got) != 1 || got[0] != "everything else" {
		t.Errorf("no rules: rows %v", got)
	}
}

func mustRows(rows []topicRow, _ bool) []topicRow { return rows }
