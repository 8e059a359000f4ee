package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// writtenMetric is tandem's counter of the bytes its storage layer wrote,
// by file (docs/monitoring.md).
const writtenMetric = "tandem_storage_written_bytes_total"

// StorageWritten is what a tandem gateway's storage layer wrote into its
// data dir, in bytes, by file, as its /metrics says: beside the device's
// own counters it shows what the file system adds (its journal, its
// metadata).
type StorageWritten struct {
	WAL      float64 `json:"wal"`
	Data     float64 `json:"data"`
	Snapshot float64 `json:"snapshot"`
}

// Per is w divided by n (bytes per message); zero for no messages.
func (w StorageWritten) Per(n int64) StorageWritten {
	if n <= 0 {
		return StorageWritten{}
	}
	f := float64(n)
	return StorageWritten{WAL: w.WAL / f, Data: w.Data / f, Snapshot: w.Snapshot / f}
}

// Sub is w minus an earlier reading.
func (w StorageWritten) Sub(w0 StorageWritten) StorageWritten {
	return StorageWritten{WAL: w.WAL - w0.WAL, Data: w.Data - w0.Data, Snapshot: w.Snapshot - w0.Snapshot}
}

// Total is the bytes of every file.
func (w StorageWritten) Total() float64 { return w.WAL + w.Data + w.Snapshot }

// ReadStorageWritten scrapes the /metrics of the tandem gateway whose HTTP
// API listens at addr (host:port). A broker that is not tandem, or a
// tandem from before the counter, is an error.
func ReadStorageWritten(ctx context.Context, addr string) (StorageWritten, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return StorageWritten{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return StorageWritten{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return StorageWritten{}, fmt.Errorf("GET %s/metrics: %s", addr, resp.Status)
	}
	return parseStorageWritten(resp.Body)
}

// parseStorageWritten reads the written-bytes counters, by file, from a
// /metrics page in the Prometheus text format.
func parseStorageWritten(r io.Reader) (StorageWritten, error) {
	var w StorageWritten
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return w, fmt.Errorf("reading /metrics: %w", err)
	}
	fam := fams[writtenMetric]
	if fam == nil {
		return w, fmt.Errorf("no %s in /metrics (not tandem, or a tandem before it)", writtenMetric)
	}
	for _, m := range fam.GetMetric() {
		v := m.GetCounter().GetValue()
		for _, l := range m.GetLabel() {
			if l.GetName() != "file" {
				continue
			}
			switch l.GetValue() {
			case "wal":
				w.WAL = v
			case "data":
				w.Data = v
			case "snapshot":
				w.Snapshot = v
			}
		}
	}
	return w, nil
}
