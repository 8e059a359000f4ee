package config

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"reflect"
	"regexp"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// configWalker checks a parsed YAML tree against Config's shape by
// reflection on the yaml tags, so that errors carry the key path and line,
// and records the line of every key for the errors of Validate.
type configWalker struct {
	file  string
	lines map[string]int // key path -> line of the key (list item: of the item)
	errs  ErrorList      // what the walk found, in the order it did
}

var yamlErrRE = regexp.MustCompile(`(?s)^(?:yaml: )?line (\d+): (.*)$`)

// parse returns the document's top-level mapping, or nil for an empty
// document.
func (w *configWalker) parse(data []byte) (*yaml.Node, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) { // empty, or comments only
			return nil, nil
		}
		return nil, w.syntaxError(err, data)
	}
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case err == nil:
		return nil, w.errorf(next.Line, "", "a second YAML document starts here; a config file holds one document")
	case !errors.Is(err, io.EOF):
		return nil, w.syntaxError(err, data)
	}
	if len(doc.Content) == 0 || isYAMLNull(doc.Content[0]) {
		return nil, nil
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, w.errorf(root.Line, "", "the top level must be a mapping of sections (node:, mqtt:, ...), not %s", describeYAMLNode(root))
	}
	return root, nil
}

func (w *configWalker) syntaxError(err error, data []byte) error {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	line := 0
	if m := yamlErrRE.FindStringSubmatch(err.Error()); m != nil {
		line, _ = strconv.Atoi(m[1])
		msg = m[2]
	}
	if tabIndentedLine(data, line) {
		msg += " (indent with spaces: YAML does not allow tabs)"
	}
	return w.errorf(line, "", "%s", msg)
}

// tabIndentedLine reports whether the given 1-based line is indented with a
// tab, the most common cause of yaml's cryptic "found character that cannot
// start any token".
func tabIndentedLine(data []byte, line int) bool {
	if line < 1 {
		return false
	}
	lines := bytes.SplitN(data, []byte("\n"), line+1)
	if len(lines) < line {
		return false
	}
	l := lines[line-1]
	indent := l[:len(l)-len(bytes.TrimLeft(l, " \t"))]
	return bytes.IndexByte(indent, '\t') >= 0
}

var yamlUnmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()

// walk checks n against type t at key path, noting every problem (note)
// and going on; false means n is bad and its parent drops it (prune), so
// that the rest of the file still decodes and is validated. It recurses
// only along t, so it stays shallow whatever the document holds (aliases
// included). Inside an alias, aliasLine is the alias's line: errors and
// recorded lines point where the value is used, which is what the key path
// names.
func (w *configWalker) walk(n *yaml.Node, t reflect.Type, path string, aliasLine int) bool {
	if n.Kind == yaml.AliasNode && aliasLine == 0 {
		aliasLine = n.Line
	}
	line := cmp.Or(aliasLine, n.Line)
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	if isYAMLNull(n) {
		return true // a key with no value keeps its default
	}
	if reflect.PointerTo(t).Implements(yamlUnmarshalerType) {
		return w.note(w.leaf(n, line, t, path))
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			return w.note(w.errorf(line, path, "expected a mapping of keys (%s), got %s", strings.Join(yamlFieldNames(t), ", "), describeYAMLNode(n)))
		}
		w.mapping(n, t, path, aliasLine)
		return true
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			return w.note(w.errorf(line, path, "expected a list, got %s", describeYAMLNode(n)))
		}
		ok := true
		for i, item := range n.Content {
			key := fmt.Sprintf("%s[%d]", path, i)
			w.lines[key] = cmp.Or(aliasLine, item.Line)
			// A bad item drops the whole list: dropping the item alone
			// would renumber the ones after it in later errors.
			ok = w.walk(item, t.Elem(), key, aliasLine) && ok
		}
		return ok
	}
	return w.note(w.leaf(n, line, t, path))
}

// note records err, if any, and returns whether there was none.
func (w *configWalker) note(err error) bool {
	if err == nil {
		return true
	}
	w.errs.add(err)
	return false
}

// mapping walks n's keys, dropping from n those it notes a problem with.
func (w *configWalker) mapping(n *yaml.Node, t reflect.Type, path string, aliasLine int) {
	fields := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if name, _, _ := strings.Cut(f.Tag.Get("yaml"), ","); f.IsExported() && name != "" && name != "-" {
			fields[name] = f.Type
		}
	}
	firstLine := map[string]int{}
	keep := n.Content[:0:0]
	for i := 0; i+1 < len(n.Content); i += 2 {
		if w.pair(n.Content[i], n.Content[i+1], t, fields, firstLine, path, aliasLine) {
			keep = append(keep, n.Content[i], n.Content[i+1])
		}
	}
	n.Content = keep
}

// pair checks one key and its value of a mapping; false drops them.
func (w *configWalker) pair(k, v *yaml.Node, t reflect.Type, fields map[string]reflect.Type, firstLine map[string]int, path string, aliasLine int) bool {
	line := cmp.Or(aliasLine, k.Line)
	if k.Kind != yaml.ScalarNode {
		return w.note(w.errorf(line, path, "a key must be a plain name, not %s", describeYAMLNode(k)))
	}
	key := k.Value
	if path != "" {
		key = path + "." + k.Value
	}
	if k.ShortTag() == "!!merge" {
		// The walk would have to mirror yaml.v3's override rules to
		// know each key's line; a config file does not need merges.
		return w.note(w.errorf(line, path, "merge keys (<<) are not supported; write the keys out"))
	}
	ft, ok := fields[k.Value]
	if !ok {
		return w.note(w.errorf(line, key, "unknown key %q%s", key, unknownKeyHint(k.Value, path, yamlFieldNames(t))))
	}
	if first, dup := firstLine[k.Value]; dup {
		return w.note(w.errorf(line, key, "duplicate key %q (first at line %d)", key, first))
	}
	firstLine[k.Value] = k.Line
	w.lines[key] = line
	return w.walk(v, ft, key, aliasLine)
}

// leaf decodes a scalar into a scratch value of type t to find type errors
// while the key path is known.
func (w *configWalker) leaf(n *yaml.Node, line int, t reflect.Type, path string) error {
	isInt := t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64 && !reflect.PointerTo(t).Implements(yamlUnmarshalerType)
	if isInt && n.Kind == yaml.ScalarNode && n.ShortTag() != "!!int" {
		// yaml.v3 would truncate 1.5 to 1.
		return w.errorf(line, path, "%s is not a whole number", quoteConfigValue(n.Value))
	}
	err := n.Decode(reflect.New(t).Interface())
	if err == nil {
		return nil
	}
	var ce *ConfigError
	if errors.As(err, &ce) {
		// line, not ce.Line: for an alias, the place of use, where path is.
		return w.errorf(line, path, "%s", ce.Msg)
	}
	switch {
	case n.Kind != yaml.ScalarNode:
		return w.errorf(line, path, "expected %s, got %s", yamlKindWord(t), describeYAMLNode(n))
	case t.Kind() == reflect.Bool:
		return w.errorf(line, path, "%s is not true or false", quoteConfigValue(n.Value))
	case isInt:
		return w.errorf(line, path, "%s is out of range", quoteConfigValue(n.Value))
	}
	return w.errorf(line, path, "%s is not %s", quoteConfigValue(n.Value), yamlKindWord(t))
}

// decodeError turns an error of the final yaml.v3 decode into a ConfigError.
func (w *configWalker) decodeError(err error) error {
	var ce *ConfigError
	if errors.As(err, &ce) {
		return w.errorf(ce.Line, w.keyAt(ce.Line), "%s", ce.Msg)
	}
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	var te *yaml.TypeError
	if errors.As(err, &te) && len(te.Errors) > 0 {
		msg = te.Errors[0]
	}
	line := 0
	if m := yamlErrRE.FindStringSubmatch(msg); m != nil {
		line, _ = strconv.Atoi(m[1])
		msg = m[2]
	}
	return w.errorf(line, w.keyAt(line), "%s", msg)
}

// keyAt returns the deepest key path recorded at line, or "".
func (w *configWalker) keyAt(line int) string {
	best := ""
	for k, l := range w.lines {
		if l == line && line > 0 && (len(k) > len(best) || len(k) == len(best) && k < best) {
			best = k
		}
	}
	return best
}

func (w *configWalker) errorf(line int, key, format string, args ...any) *ConfigError {
	return &ConfigError{File: w.file, Line: max(line, 0), Key: key, Msg: fmt.Sprintf(format, args...)}
}

// line returns the line of key, or else of its nearest ancestor in the
// file, so that an error about a missing key points at its section.
func (w *configWalker) line(key string) int {
	if w == nil {
		return 0
	}
	for key != "" {
		if l, ok := w.lines[key]; ok {
			return l
		}
		i := strings.LastIndexAny(key, ".[")
		if i < 0 {
			break
		}
		key = key[:i]
	}
	return 0
}

func yamlFieldNames(t reflect.Type) []string {
	var keys []string
	for i := range t.NumField() {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ","); name != "" && name != "-" {
			keys = append(keys, name)
		}
	}
	return keys
}

// unknownKeyHint suggests the known key nearest to a misspelt one, or lists them.
func unknownKeyHint(key, path string, known []string) string {
	best, bestDist := "", 3 // more than 2 edits is a different word
	for _, k := range known {
		if d := keyEditDistance(strings.ToLower(key), k); d < bestDist {
			best, bestDist = k, d
		}
	}
	if best != "" {
		if path != "" {
			best = path + "." + best
		}
		return fmt.Sprintf(" (did you mean %q?)", best)
	}
	if path == "" {
		return "; the sections are " + strings.Join(known, ", ")
	}
	return fmt.Sprintf("; %s takes %s", path, strings.Join(known, ", "))
}

func keyEditDistance(a, b string) int {
	ra, rb := []rune(a), []rune(b)
	prev := make([]int, len(rb)+1)
	cur := make([]int, len(rb)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(ra); i++ {
		cur[0] = i
		for j := 1; j <= len(rb); j++ {
			sub := prev[j-1]
			if ra[i-1] != rb[j-1] {
				sub++
			}
			cur[j] = min(sub, prev[j]+1, cur[j-1]+1)
		}
		prev, cur = cur, prev
	}
	return prev[len(rb)]
}

func isYAMLNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

func describeYAMLNode(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.AliasNode:
		return "an alias"
	case yaml.ScalarNode:
		return quoteConfigValue(n.Value)
	}
	return "nothing"
}

func yamlKindWord(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		return "a list"
	case reflect.Float32, reflect.Float64:
		return "a number"
	}
	if t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64 {
		return "a whole number"
	}
	return "a " + t.Kind().String()
}

// quoteConfigValue quotes a value from the file for a message, cut short so that
// a pasted blob does not flood the terminal.
func quoteConfigValue(s string) string {
	const maxLen = 64
	if len(s) > maxLen {
		return strconv.Quote(s[:maxLen]) + "..."
	}
	return strconv.Quote(s)
}
