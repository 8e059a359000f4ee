package daemon

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/bench"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// /metrics says what the storage layer wrote, by file, as DB.Written
// counts it: the bench suite sets it beside the device's own counters, so
// what the file system adds (its journal, its metadata) shows (#36).
func TestMetricsCountTheBytesTheStorageWrote(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	pub, _ := v5(t, d.MQTTAddr(), "written-pub", nil)
	for i := range 50 {
		publish(t, pub, &paho.Publish{Topic: "w/t", QoS: 1, Payload: []byte{byte(i)}})
	}
	var w storage.Written
	var m bench.StorageWritten
	var err error
	// The gateway writes on its own (settlements, checkpoints): compare
	// a scrape with counts that did not move across it.
	testutil.WaitFor(t, 10*time.Second, "/metrics to say what DB.Written says", func() bool {
		w = d.db.Written()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		m, err = bench.ReadStorageWritten(ctx, d.HTTPAddr())
		return err == nil && d.db.Written() == w &&
			m == bench.StorageWritten{WAL: float64(w.WAL), Data: float64(w.Data), Snapshot: float64(w.Snapshot)}
	}, func() string { return fmt.Sprintf("DB.Written %+v, /metrics %+v (%v)", w, m, err) })
	// Every QoS 1 publish was fdatasynced before its ack, one at a time:
	// about a page each.
	if w.WAL < 50*4096/2 {
		t.Errorf("the WAL wrote %d bytes for 50 publishes acked one by one", w.WAL)
	}
}
