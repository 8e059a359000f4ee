// Package config is tandem.yaml: its schema, its decoding with file:line
// errors, its validation and its defaults. It is the one place that knows
// the config keys of DESIGN.md; the daemon, the command line and the control
// plane read a *Config and never parse YAML themselves.
//
// What lives where:
//   - config.go: the schema (Config and its sections, each field documented
//     with its key), DefaultConfig, Load, Parse and ConfigError.
//   - decode.go: the walker that checks the YAML tree against the schema by
//     reflection on the yaml tags, so that an unknown key, a wrong type or a
//     duplicate is reported with its key path and line (with a "did you
//     mean" hint), and records every key's line for Validate's errors; it
//     drops what it finds wrong and goes on, so the rest is still checked.
//   - units.go: Duration and ByteSize, the two value types written as
//     strings ("5s", "256MiB").
//   - validate.go: Validate, which fills zero fields with their defaults and
//     then checks the whole Config (listen addresses, TLS, limits, topic
//     rules).
//   - check.go: every error of a file at once (ErrorList, LoadAll,
//     ErrorAt for the daemon's checks of the files a config names) and the
//     rule that each listener has a port of its own.
//
// A Config is a plain value: nothing in this package holds a lock or starts
// a goroutine. Callers that change a Config shared with running code (a
// reload) build a fresh one and swap it in.
package config
