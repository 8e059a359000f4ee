package daemon

import (
	"fmt"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

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
	// The gateway writes on its own (settlements, checkpoints): compare
	// a scrape with counts that did not move across it.
	testutil.WaitFor(t, 10*time.Second, "/metrics to say what DB.Written says", func() bool {
		w = d.db.Written()
		mfs := scrape(t, d)
		return d.db.Written() == w &&
			value(mfs, "tandem_storage_written_bytes_total", "file", "wal") == float64(w.WAL) &&
			value(mfs, "tandem_storage_written_bytes_total", "file", "data") == float64(w.Data) &&
			value(mfs, "tandem_storage_written_bytes_total", "file", "snapshot") == float64(w.Snapshot)
	}, func() string {
		mfs := scrape(t, d)
		return fmt.Sprintf("DB.Written %+v, /metrics wal %v data %v snapshot %v", d.db.Written(),
			value(mfs, "tandem_storage_written_bytes_total", "file", "wal"),
			value(mfs, "tandem_storage_written_bytes_total", "file", "data"),
			value(mfs, "tandem_storage_written_bytes_total", "file", "snapshot"))
	})
	// Every QoS 1 publish was fdatasynced before its ack, one at a time:
	// about a page each.
	if w.WAL < 50*4096/2 {
		t.Errorf("the WAL wrote %d bytes for 50 publishes acked one by one", w.WAL)
	}
}
