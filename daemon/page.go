package daemon

import "net/http"

// registerFieldView adds the field view's endpoints (status page, metrics)
// to the HTTP listener's mux.
func (d *Daemon) registerFieldView(mux *http.ServeMux) {}
