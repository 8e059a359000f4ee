package admin

import "net/http"

// Uplinks is what the uplink endpoints need of the gateway: pausing and
// resuming an uplink, on every member.
type Uplinks interface {
	// SetPaused pauses (or resumes) the uplink called name. It fails with
	// a config.UsageError for an unknown name and with ErrNoMaster
	// (wrapped) when the cluster cannot log it.
	SetPaused(name string, paused bool) (UplinkResponse, error)
}

// UplinkRequest is the body of POST /v1/uplink/pause and /v1/uplink/resume.
type UplinkRequest struct {
	Name string `json:"name"`
}

// UplinkResponse answers them: the uplink's state after the command.
type UplinkResponse struct {
	Name   string `json:"name"`
	Paused bool   `json:"paused"`
}

// HandleUplinks registers the uplink commands (`tandem uplink pause|resume
// NAME`), behind the mutating guard.
func (s *Server) HandleUplinks(u Uplinks) {
	s.HandleMutating("/v1/uplink/pause", func(w http.ResponseWriter, r *http.Request) { handleUplink(w, r, u, true) })
	s.HandleMutating("/v1/uplink/resume", func(w http.ResponseWriter, r *http.Request) { handleUplink(w, r, u, false) })
}

func handleUplink(w http.ResponseWriter, r *http.Request, u Uplinks, paused bool) {
	var req UplinkRequest
	if err := DecodeBody(r, &req); err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	out, err := u.SetPaused(req.Name, paused)
	if err != nil {
		WriteError(w, statusOf(err), err)
		return
	}
	WriteJSON(w, http.StatusOK, out)
}
