// Package admin is the gateway's HTTP side (http.listen): the /v1 API,
// /healthz, /metrics and the status page a field engineer opens on a phone.
// It reads the running gateway through the Gateway interface it declares
// (status, health, the config in force, a few counters) and the cluster
// commands through the Cluster interface, so it knows nothing of storage,
// the control plane or the broker; the daemon implements both.
//
// What lives where:
//   - server.go: Server (the listener, its bounds, /healthz, /v1/status)
//     and Gateway.
//   - guard.go: the API guard. Every request must name this listener in
//     Host; a mutating one must also come from no other origin, be JSON and
//     carry the API token (TokenFile, ReadToken: the CLI reads it the same
//     way). The listener holds at most a handful of connections.
//   - api.go: the JSON requests and answers of the cluster API shared with
//     the CLI, and the helpers that read and write them.
//   - clusterapi.go: Cluster and the endpoints that change the cluster
//     (/v1/cluster/invite, join, remove, promote; /v1/pair/open, join).
//   - status.go: Status, the status JSON of the contract.
//   - metrics.go: FieldView, the Prometheus registry and the hot path's
//     counters (the broker's mqtt.Observer, the storage's OnCommit), and
//     the gauges read from Status at scrape time.
//   - history.go, page.go, page.html: the page's sparklines (a sampler
//     every 5 s into a ring of 10 minutes) and its rendering.
//   - uplinkapi.go, uplinkmetrics.go, uplinkpage.go: the uplinks' commands
//     (/v1/uplink/pause, resume), their tandem_uplink_* metrics and their
//     rows and backlog sparkline on the page.
//   - pprof.go: `tandem run --pprof`.
//
// Concurrency: FieldView's counters are atomics written on the hot path
// without locks or allocations; the history ring is guarded by its mutex.
// Goroutines: Server.Start starts the HTTP Serve goroutine (Server.Stop
// shuts it down and waits for it) and the FieldView's sampler (FieldView.Stop
// stops it and waits); ServePprof starts a Serve goroutine of its own,
// which the stop function it returns closes and waits for.
package admin
