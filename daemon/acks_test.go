package daemon

import (
	"errors"
	"testing"

	"github.com/tandem-edge/tandem/mqtt"
)

// The ack queue hands outcomes on in the order they came, on its own
// goroutine (never the pusher's, replication's); stop delivers what is
// queued, and an outcome pushed after it still reaches its callback once.
func TestAckQueueKeepsOrderAndDeliversEverything(t *testing.T) {
	q := newAckQueue()
	var got []int
	for i := range 1000 {
		q.push(mqtt.DoneFunc(func(error) { got = append(got, i) }), nil)
	}
	q.stop()
	if len(got) != 1000 {
		t.Fatalf("%d outcomes delivered of 1000", len(got))
	}
	for i, v := range got {
		if v != i {
			t.Fatalf("outcome %d delivered as the %dth", v, i)
		}
	}
	var late error
	q.push(mqtt.DoneFunc(func(err error) { late = err }), errors.New("stopped"))
	if late == nil {
		t.Fatal("an outcome pushed after stop was not delivered")
	}
}
