package admin

import (
	"net"
	"net/http"
	"net/http/pprof"
	"sync"
	"time"
)

// ServePprof serves net/http/pprof's handlers on addr, apart from the API
// (`tandem run --pprof`), until stop is called: stop closes the server and
// its connections and waits for its Serve goroutine.
func ServePprof(addr string) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
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
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = srv.Serve(ln) // ErrServerClosed once stop closes it
	}()
	return func() {
		_ = srv.Close()
		wg.Wait()
	}, nil
}
