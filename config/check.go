package config

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"net"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
)

// Every error of a file at once.
//
// Load, Parse and Validate report every problem they find, not the first
// only: a field engineer fixing a config on site should not need one run
// per mistake. A file's problems come back as an ErrorList in the order
// they were found (the file's form first: syntax, keys, values; then the
// rules between values), a single one as a plain *ConfigError. `tandem check` and `tandem run`
// go through the same checks: this package's, then the daemon's reading of
// the files the config names (users, ACL, TLS, token), both with LoadAll.

// ErrorList is several ConfigErrors of one file, in line order. errors.As
// finds the first *ConfigError in it.
type ErrorList []*ConfigError

// Error lists the errors, one per line.
func (l ErrorList) Error() string {
	msgs := make([]string, len(l))
	for i, e := range l {
		msgs[i] = e.Error()
	}
	return strings.Join(msgs, "\n")
}

// Unwrap returns the errors, for errors.As and errors.Is.
func (l ErrorList) Unwrap() []error {
	out := make([]error, len(l))
	for i, e := range l {
		out[i] = e
	}
	return out
}

// Err returns nil for no errors, the *ConfigError itself for one, and the
// list for more.
func (l ErrorList) Err() error {
	switch len(l) {
	case 0:
		return nil
	case 1:
		return l[0]
	}
	// In the order of the file's lines, as a reader fixes them; errors
	// of no line (a file that cannot be read, a Config built in code)
	// last, in the order they were found.
	slices.SortStableFunc(l, func(a, b *ConfigError) int {
		return cmp.Compare(lineKey(a), lineKey(b))
	})
	return l
}

// lineKey orders an error by its line, those of none after every line.
func lineKey(e *ConfigError) int {
	if e.Line <= 0 {
		return math.MaxInt
	}
	return e.Line
}

// add appends err's ConfigErrors (a list is flattened); another error
// becomes a ConfigError of its own.
func (l *ErrorList) add(err error) {
	var list ErrorList
	var ce *ConfigError
	switch {
	case err == nil:
	case errors.As(err, &list):
		*l = append(*l, list...)
	case errors.As(err, &ce):
		*l = append(*l, ce)
	default:
		*l = append(*l, &ConfigError{Msg: err.Error(), Err: err})
	}
}

// Join returns the errors of errs (ConfigErrors or lists of them; nils are
// skipped) as one error: nil, a *ConfigError, or an ErrorList.
func Join(errs ...error) error {
	var l ErrorList
	for _, err := range errs {
		l.add(err)
	}
	return l.Err()
}

// LoadAll is Load for a checker: besides the errors, it returns the Config
// as far as the file could be read (nil when it could not be parsed at
// all), so that what the daemon checks beyond this package can be checked
// too, and every error of the file reported at once.
func LoadAll(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, readError(path, err)
	}
	c, err := parse(data, path)
	if c != nil {
		c.file = path
	}
	return c, err
}

// ErrorAt is a ConfigError for key with err's text, naming the file and
// the key's line when the Config came from one: for the checks of the
// files a config names, done where they are read.
func (c *Config) ErrorAt(key string, err error) *ConfigError {
	return &ConfigError{File: c.file, Line: c.walker().line(key), Key: key, Msg: strings.TrimPrefix(err.Error(), key+": "), Err: err}
}

// walker is a configWalker holding the lines of the file c came from, nil
// for a Config that came from none. The file is read again: a Config
// stays a plain value (comparable, copyable), and only errors need lines.
func (c *Config) walker() *configWalker {
	if c.file == "" {
		return nil
	}
	w := &configWalker{file: c.file, lines: map[string]int{}}
	if data, err := os.ReadFile(c.file); err == nil {
		if root, err := w.parse(data); err == nil && root != nil {
			w.walk(root, reflect.TypeFor[Config](), "", 0)
		}
	}
	return w
}

// listener is one of the config's listen addresses.
type listener struct {
	key, addr string
}

// ports reports two listeners on one port whose hosts overlap (the same
// host, or either one every interface): the second could never bind.
func (ck *configChecker) ports(c *Config) {
	ls := []listener{{"mqtt.listen", c.MQTT.Listen}}
	if c.MQTT.TLS.Enabled() {
		ls = append(ls, listener{"mqtt.tls.listen", c.MQTT.TLS.Listen})
	}
	ls = append(ls, listener{"mqtt.websocket.listen", c.MQTT.WebSocket.Listen},
		listener{"peer.listen", c.Peer.Listen}, listener{"http.listen", c.HTTP.Listen})
	type bound struct {
		listener
		host string
	}
	var seen []bound
	for _, l := range ls {
		host, p, err := net.SplitHostPort(l.addr)
		port, perr := strconv.ParseUint(p, 10, 16)
		if l.addr == "" || err != nil || perr != nil || port == 0 {
			continue // off, reported elsewhere, or a port the system picks
		}
		for _, s := range seen {
			_, sp, _ := net.SplitHostPort(s.addr)
			if sp == p && (s.host == host || anyHost(s.host) || anyHost(host)) {
				ck.failf(l.key, "%s uses port %d, as %s (%s) does: each listener needs a port of its own", quoteConfigValue(l.addr), port, s.key, quoteConfigValue(s.addr))
				break
			}
		}
		seen = append(seen, bound{l, host})
	}
}

// anyHost reports whether a listen host means every interface.
func anyHost(h string) bool {
	return h == "" || h == "0.0.0.0" || h == "::" || h == "[::]"
}

// unwrapPath drops the path of a *fs.PathError: File names it already.
func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// readError is Load's error for a file it cannot read.
func readError(path string, err error) error {
	return &ConfigError{File: path, Msg: fmt.Sprintf("cannot read: %v", unwrapPath(err)), Err: err}
}
