package config

import (
	"flag"
	"fmt"
	"os"
	"path"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// updateDocs rewrites docs/configuration.md's table from Reference
// (`make docs`) instead of comparing them.
var updateDocs = flag.Bool("update-docs", false, "rewrite the table of docs/configuration.md from Reference")

const (
	referenceDoc   = "../docs/configuration.md"
	referenceBegin = "<!-- Generated from config/reference.go by `make docs`: edit the rows there. -->\n\n"
	referenceEnd   = "\n<!-- End of the generated table. -->"
)

// renderReference is the markdown table of Reference.
func renderReference() string {
	var b strings.Builder
	b.WriteString("| key | default | meaning |\n|---|---|---|\n")
	for _, r := range Reference {
		keys := make([]string, len(r.Keys))
		for i, k := range r.Keys {
			keys[i] = "`" + k + "`"
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", strings.Join(keys, ", "), r.Default, r.Meaning)
	}
	return b.String()
}

// docs/configuration.md's table is Reference's: a row edited in the
// docs and not in config/reference.go (or the other way) fails here.
func TestConfigReferenceIsGenerated(t *testing.T) {
	b, err := os.ReadFile(referenceDoc)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, referenceBegin)
	j := strings.Index(doc, referenceEnd)
	if i < 0 || j < i {
		t.Fatalf("%s has no generated table between %q and %q", referenceDoc, referenceBegin, referenceEnd)
	}
	i += len(referenceBegin)
	want := renderReference()
	if *updateDocs {
		if err := os.WriteFile(referenceDoc, []byte(doc[:i]+want+doc[j:]), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	if doc[i:j] != want {
		t.Errorf("%s's table is not what config/reference.go gives: edit the rows there and run `make docs`", referenceDoc)
	}
}

// schemaKeys are tandem.yaml's keys as Config's yaml tags have them:
// "mqtt.tls.cert_file", a list's fields as "uplinks[].tls.ca_file".
func schemaKeys(t reflect.Type, prefix string, out map[string]bool) {
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "" || name == "-" || !f.IsExported() {
			continue
		}
		key := prefix + name
		switch ft := f.Type; {
		case ft.Kind() == reflect.Struct:
			schemaKeys(ft, key+".", out)
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
			out[key] = true
			schemaKeys(ft.Elem(), key+"[].", out)
		default:
			out[key] = true
		}
	}
}

// referenceKeys are Reference's rows with their relative keys (".tls"
// after "mqtt.websocket.listen") made whole.
func referenceKeys() [][]string {
	var rows [][]string
	for _, r := range Reference {
		var keys []string
		last := ""
		for _, k := range r.Keys {
			if strings.HasPrefix(k, ".") && last != "" {
				k = last[:strings.LastIndex(last, ".")] + k
			}
			keys = append(keys, k)
			last = k
		}
		rows = append(rows, keys)
	}
	return rows
}

// Every key of the schema is in the reference, and every key the
// reference names is one of the schema: a key added without its
// documentation, or documented under a name the parser refuses, fails
// here. A row may name keys by a pattern ("mqtt.max_topic_*"), or name a
// list or section ("uplinks"), whose fields its Meaning must then name.
func TestConfigReferenceNamesEveryKey(t *testing.T) {
	schema := map[string]bool{}
	schemaKeys(reflect.TypeOf(Config{}), "", schema)
	rows := referenceKeys()
	names := func(meaning, field string) bool {
		return regexp.MustCompile("`[^`]*\\b" + regexp.QuoteMeta(field) + "\\b[^`]*`").MatchString(meaning)
	}
	covered := func(key string) bool {
		for i, keys := range rows {
			for _, d := range keys {
				if ok, _ := path.Match(d, key); ok {
					return true
				}
				if strings.HasPrefix(key, d+"[].") || strings.HasPrefix(key, d+".") {
					if names(Reference[i].Meaning, key[strings.LastIndex(key, ".")+1:]) {
						return true
					}
				}
			}
		}
		return false
	}
	var missing []string
	for k := range schema {
		if !covered(k) {
			missing = append(missing, k)
		}
	}
	slices.Sort(missing)
	for _, k := range missing {
		t.Errorf("config/reference.go does not document the key %s", k)
	}
	for _, keys := range rows {
		for _, d := range keys {
			known := false
			for k := range schema {
				if ok, _ := path.Match(d, k); ok || strings.HasPrefix(k, d+".") || strings.HasPrefix(k, d+"[].") {
					known = true
				}
			}
			if !known {
				t.Errorf("config/reference.go documents %s, which is no key of the schema", d)
			}
		}
	}
}

// valueAt is the value of a whole key ("cluster.sync_timeout") in c.
func valueAt(c *Config, key string) (reflect.Value, bool) {
	v := reflect.ValueOf(c).Elem()
next:
	for _, part := range strings.Split(key, ".") {
		if v.Kind() != reflect.Struct {
			return v, false
		}
		for i := range v.NumField() {
			if name, _, _ := strings.Cut(v.Type().Field(i).Tag.Get("yaml"), ","); name == part {
				v = v.Field(i)
				continue next
			}
		}
		return v, false
	}
	return v, true
}

// A default the reference gives as a value (`5s` for
// cluster.sync_timeout) is DefaultConfig's: a default changed in the code
// and not in the docs fails here. Defaults given in words, and keys whose
// default is applied elsewhere (zero in DefaultConfig), are not compared.
func TestConfigReferenceDefaultsAreTheDefaults(t *testing.T) {
	def := DefaultConfig()
	compared := 0
	for i, keys := range referenceKeys() {
		parts := strings.Split(Reference[i].Default, ", ")
		if len(parts) != len(keys) {
			continue
		}
		for j, key := range keys {
			p := parts[j]
			if !strings.HasPrefix(p, "`") || strings.Count(p, "`") != 2 || !strings.HasSuffix(strings.Fields(p)[0], "`") {
				continue
			}
			doc := strings.Trim(strings.Fields(p)[0], "`")
			v, ok := valueAt(def, key)
			if !ok || v.IsZero() && v.Kind() != reflect.Bool {
				continue
			}
			compared++
			if got := fmt.Sprint(v.Interface()); got != doc {
				t.Errorf("%s: the reference says the default is %s, DefaultConfig has %s", key, doc, got)
			}
		}
	}
	t.Logf("%d defaults compared", compared)
	if compared < 15 {
		t.Errorf("only %d defaults compared", compared)
	}
}
