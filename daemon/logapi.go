package daemon

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/internal/inspect"
)

// handleLog answers POST /v1/log: `tandem inspect` of this running
// gateway, whose data dir the CLI cannot open while the daemon holds it.
// It reads the log as the applier does, through the open data file,
// changing nothing.
func (d *Daemon) handleLog(w http.ResponseWriter, r *http.Request) {
	var req admin.LogRequest
	if err := admin.DecodeBody(r, &req); err != nil {
		admin.WriteError(w, http.StatusBadRequest, err)
		return
	}
	q := inspect.Query(req)
	if _, ok := inspect.Encoders[q.Payload]; !ok && q.Payload != "" {
		admin.WriteError(w, http.StatusBadRequest, fmt.Errorf("payload encoding %q: base64, text or hex", q.Payload))
		return
	}
	w.Header().Set("Content-Type", "application/x-ndjson")
	if err := inspect.Write(w, d.db, q); err != nil {
		// The status line is gone with the first line written: say it in
		// the stream, where the CLI prints it.
		json.NewEncoder(w).Encode(admin.ErrorResponse{Error: err.Error()})
	}
}
