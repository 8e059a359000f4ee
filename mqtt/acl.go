package mqtt

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"unicode/utf8"
)

// ACL is a parsed ACL file in Mosquitto's acl_file syntax, so that a
// Mosquitto installation's ACLs carry over:
//
//	# lines before the first "user" apply to anonymous clients
//	topic read public/#
//	user alice
//	topic readwrite alice/#
//	topic deny alice/secret
//	pattern write devices/%c/status
//
// "topic [read|write|readwrite|deny] FILTER" grants (or, with deny, refuses)
// access to what FILTER matches for the current section's user; no access
// word means readwrite. "pattern" lines have the same form and apply to
// every client wherever they appear, with %u replaced by the user name and
// %c by the client id. As in Mosquitto, once an ACL file is set anything it
// does not grant is refused, and deny wins over any grant.
//
// An ACL is immutable once parsed; a reload builds a new one and swaps it.
type ACL struct {
	anonymous []aclRule
	users     map[string][]aclRule
	patterns  []aclRule
}

// access is what a rule grants or refuses.
type access uint8

const (
	accessRead access = 1 << iota
	accessWrite
	accessDeny
)

type aclRule struct {
	filter string
	access access
}

// LoadACL reads the ACL file at path. Errors name the file and line.
func LoadACL(path string) (*ACL, error) { return loadFile(path, "acl file", ParseACL) }

// loadFile opens path and parses it with parse; what names the file in
// the error of an open that fails.
func loadFile[T any](path, what string, parse func(io.Reader, string) (T, error)) (T, error) {
	f, err := os.Open(path)
	if err != nil {
		var zero T
		return zero, fmt.Errorf("%s: %w", what, err)
	}
	defer f.Close()
	return parse(f, path)
}

// ParseACL parses an ACL file; name is the file name used in errors. Unlike
// Mosquitto, which skips lines it does not understand, it refuses them: a
// typo in an ACL should stop a reload, not quietly change who may do what.
func ParseACL(r io.Reader, name string) (*ACL, error) {
	a := &ACL{users: map[string][]aclRule{}}
	user, inUser := "", false
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		kw, rest := line, ""
		if i := strings.IndexAny(line, " \t"); i >= 0 {
			kw, rest = line[:i], strings.TrimSpace(line[i+1:])
		}
		switch kw {
		case "user":
			if err := CheckUserName(rest); err != nil {
				return nil, fmt.Errorf("%s:%d: user: %w", name, n, err)
			}
			user, inUser = rest, true
			if _, ok := a.users[user]; !ok {
				a.users[user] = nil // a user with no rules may do nothing
			}
		case "topic", "pattern":
			rule, err := parseACLRule(rest)
			if err != nil {
				return nil, fmt.Errorf("%s:%d: %s: %w", name, n, kw, err)
			}
			switch {
			case kw == "pattern":
				a.patterns = append(a.patterns, rule)
			case inUser:
				a.users[user] = append(a.users[user], rule)
			default:
				a.anonymous = append(a.anonymous, rule)
			}
		default:
			return nil, fmt.Errorf("%s:%d: unknown keyword %q (want user, topic or pattern)", name, n, kw)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return a, nil
}

// parseACLRule parses what follows "topic" or "pattern".
func parseACLRule(rest string) (aclRule, error) {
	if rest == "" {
		return aclRule{}, errors.New("missing topic filter")
	}
	word, after := rest, ""
	if i := strings.IndexAny(rest, " \t"); i >= 0 {
		word, after = rest[:i], strings.TrimSpace(rest[i+1:])
	}
	r := aclRule{filter: rest, access: accessRead | accessWrite}
	acc, isAccess := map[string]access{
		"read": accessRead, "write": accessWrite, "readwrite": accessRead | accessWrite, "deny": accessDeny,
	}[word]
	if isAccess {
		if after == "" {
			// Mosquitto would take the word for the filter; a rule
			// granting readwrite on a topic named "read" is surely a
			// mistake.
			return aclRule{}, fmt.Errorf("missing topic filter after %q", word)
		}
		r = aclRule{filter: after, access: acc}
	}
	if err := ValidFilter(r.filter); err != nil {
		return aclRule{}, fmt.Errorf("%q: %w", r.filter, err)
	}
	return r, nil
}

// ValidFilter applies MQTT's rules for topic filters (4.7); the config
// checks its topic rules with it too.
func ValidFilter(f string) error {
	switch {
	case f == "":
		return errors.New("empty topic filter")
	case len(f) > 65535:
		return errors.New("topic filter longer than 65535 bytes")
	case !utf8.ValidString(f):
		return errors.New("topic filter is not valid UTF-8")
	case strings.ContainsRune(f, 0):
		return errors.New("topic filter contains a NUL character")
	}
	levels := strings.Split(f, "/")
	for i, l := range levels {
		if strings.Contains(l, "#") && (l != "#" || i != len(levels)-1) {
			return errors.New("'#' must be the whole last level")
		}
		if strings.Contains(l, "+") && l != "+" {
			return errors.New("'+' must be a whole level")
		}
	}
	return nil
}

// Allowed reports whether a client may read or write topic. user is "" for
// a client that proved no user name (anonymous). For a read, topic may be a
// subscription's filter: it is allowed only if everything it can match is
// readable, so a subscription to "#" is refused to a client that may read
// only "a/#". Messages are checked again one by one as they are delivered,
// which covers the parts of an allowed filter that a deny rule takes back.
// A nil ACL allows everything (no acl_file).
func (a *ACL) Allowed(user, clientID, topic string, write bool) bool {
	if a == nil {
		return true
	}
	want := accessRead
	if write {
		want = accessWrite
	}
	rules := a.anonymous
	if user != "" {
		rules = a.users[user]
	}
	granted := false
	for _, r := range rules {
		switch {
		case r.access&accessDeny != 0:
			if covers(r.filter, topic) {
				return false
			}
		case r.access&want != 0 && !granted:
			granted = covers(r.filter, topic)
		}
	}
	for _, p := range a.patterns {
		f, ok, unsafe := substitute(p.filter, user, clientID)
		switch {
		case unsafe:
			// A name with + or # would turn a pattern into a wildcard
			// over other clients' topics: refuse that client outright,
			// as Mosquitto does.
			return false
		case !ok:
			continue // %u, and the client has no user name
		case p.access&accessDeny != 0:
			if covers(f, topic) {
				return false
			}
		case p.access&want != 0 && !granted:
			granted = covers(f, topic)
		}
	}
	return granted
}

// substitute replaces %u and %c in a pattern's filter. ok is false when the
// pattern needs a user name the client does not have; unsafe is true when
// a substituted value contains a wildcard character.
func substitute(filter, user, clientID string) (f string, ok, unsafe bool) {
	if !strings.Contains(filter, "%") {
		return filter, true, false
	}
	if strings.Contains(filter, "%u") {
		if user == "" {
			return "", false, false
		}
		if strings.ContainsAny(user, "+#") {
			return "", false, true
		}
	}
	if strings.Contains(filter, "%c") && strings.ContainsAny(clientID, "+#") {
		return "", false, true
	}
	return strings.NewReplacer("%u", user, "%c", clientID).Replace(filter), true, false
}

// covers reports whether every topic that sub matches is matched by acl.
// For a topic name (no wildcards) it is MatchTopic(acl, sub).
func covers(acl, sub string) bool {
	// Wildcards at the first level do not match topics starting with '$'
	// (4.7.2): "#" does not cover "$SYS/#".
	if strings.HasPrefix(sub, "$") && (strings.HasPrefix(acl, "+") || strings.HasPrefix(acl, "#")) {
		return false
	}
	for {
		a, arest, amore := strings.Cut(acl, "/")
		if a == "#" {
			return true
		}
		s, srest, smore := strings.Cut(sub, "/")
		switch {
		case s == "#":
			return false // sub matches any depth here, acl does not
		case a == "+":
		case s == "+" || s != a:
			return false
		}
		switch {
		case !smore:
			// "a/#" covers "a" too: the parent level.
			return !amore || arest == "#"
		case !amore:
			return false
		}
		acl, sub = arest, srest
	}
}
