// Package cli is the tandem command: the cobra command tree, its flags and
// help, the man page, and the HTTP client through which the commands talk
// to a running daemon (apiclient.go: --http, --config, --data and
// --token-file find the daemon and its API token).
//
// Commands and where they act:
//   - run: starts a gateway in this process (package daemon) until
//     SIGTERM; SIGHUP reloads. check validates a config file.
//   - status, cluster invite/join/remove, pair open/join, promote: ask the
//     running daemon over its admin API (the JSON types are admin's).
//   - peers browses mDNS itself (discovery); inspect reads a stopped
//     gateway's data dir (storage); passwd prints a users-file line; bench
//     drives a broker (bench); service installs the systemd unit
//     (packaging); version and the hidden man print what they say.
//
// Exit codes: 0 success, 1 failure, 2 a usage or config error
// (config.UsageError, config.ConfigError). Main is the whole entry point:
// main.go calls it, and the daemon's tests link it in to drive gateways as
// a user would.
//
// Goroutines: none of its own. run waits on the daemon's and the signals'
// channels on the caller's goroutine; `run --pprof`'s server is admin's,
// bench's workers are package bench's.
package cli
