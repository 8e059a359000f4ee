package daemon

import (
	"testing"
	"time"

	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/storage"
)

// While the log is over its budget the master takes a resumed session's
// start record and the release records of QoS 2 deliveries, without which
// that device is not served on a member of a cluster (subscribers keep
// being served while publishes are refused), and nothing else a device
// can make more of: publishes, subscriptions, a session's end.
func TestPastBudgetTakesOnlySessionStartAndReleaseRecords(t *testing.T) {
	rec := func(kind mqtt.Kind, topic, payload string, legacy bool) []byte {
		r := recordOf(&mqtt.Message{Kind: kind, Origin: 1, Seq: 1, ClientID: "dev", Topic: topic, Time: time.Now().UnixNano(), Payload: []byte(payload)})
		r.Legacy = legacy && kind != mqtt.KindMessage
		return storage.AppendRecord(nil, &r)
	}
	var h clusterHost
	for _, c := range []struct {
		what string
		data []byte
		want bool
	}{
		{"a start record", rec(mqtt.KindSession, "$tandem/session", `{"op":"start","expiry":60}`, false), true},
		{"a start record below feature level 2", rec(mqtt.KindSession, "$tandem/session", `{"op":"start"}`, true), true},
		{"a QoS 2 release", rec(mqtt.KindSession, "$tandem/session", `{"op":"rel","rel":[7,8]}`, false), true},
		{"a QoS 2 release below feature level 2", rec(mqtt.KindSession, "$tandem/session", `{"op":"rel","rel":[7]}`, true), true},
		{"a subscription", rec(mqtt.KindSession, "$tandem/session", `{"op":"sub","f":"a/#"}`, false), false},
		{"a session's end", rec(mqtt.KindSession, "$tandem/session", `{"op":"end"}`, false), false},
		{"a publish", rec(mqtt.KindMessage, "a/b", `{"op":"start"}`, false), false},
		{"cursors", rec(mqtt.KindCursors, "$tandem/cursors", `{"op":"start"}`, false), false},
		{"garbage", []byte("not a record"), false},
	} {
		if got := h.PastBudget(c.data); got != c.want {
			t.Errorf("%s: PastBudget %v, want %v", c.what, got, c.want)
		}
	}
}
