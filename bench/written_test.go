package bench

import (
	"strings"
	"testing"
)

// The written-bytes counters are read from a gateway's /metrics by file,
// whatever else the page holds.
func TestParseStorageWritten(t *testing.T) {
	page := `# HELP tandem_storage_written_bytes_total Bytes the storage layer wrote.
# TYPE tandem_storage_written_bytes_total counter
tandem_storage_written_bytes_total{file="data"} 2.1504e+06
tandem_storage_written_bytes_total{file="snapshot"} 0
tandem_storage_written_bytes_total{file="wal"} 4096
tandem_storage_fsyncs_total 12
`
	w, err := parseStorageWritten(strings.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	if w != (StorageWritten{WAL: 4096, Data: 2150400}) || w.Total() != 2154496 {
		t.Errorf("parsed %+v", w)
	}
	if _, err := parseStorageWritten(strings.NewReader("tandem_storage_fsyncs_total 12\n")); err == nil {
		t.Error("a page without the counter parsed")
	}
}
