package admin

import (
	"net"
	"net/http"
	"net/http/pprof"
	"time"
)

// ServePprof serves net/http/pprof's handlers on addr, apart from the API
// (`tandem run --pprof`). The server lives as long as the process: the
// flag is for a profiling session, not for a gateway in service.
func ServePprof(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	// Profiles show what the process holds; a DNS-rebinding page must not
	// read them either (guard.go), so Host is checked here too.
	g := &apiGuard{hosts: map[string]bool{"localhost": true}}
	srv := &http.Server{Handler: g.readOnly(mux), ReadHeaderTimeout: 5 * time.Second, MaxHeaderBytes: httpMaxHeaderBytes}
	go srv.Serve(ln)
	return nil
}
