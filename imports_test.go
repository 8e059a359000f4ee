package main

import (
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/tandem-edge/tandem"

// importRules are DESIGN.md's import rules, by package (relative to the
// module): the packages of ours each may import. A package not listed here
// is held only to the rules every package follows (nothing imports cli,
// nothing but cli imports daemon). uplink imports nothing of ours; config
// validates `uplinks:` with its rules and admin reports its Status. internal/ packages are helpers anyone
// may import, except the two leaves, mqtt and discovery, which import no
// package of ours at all.
var importRules = map[string][]string{
	"mqtt":        {},
	"discovery":   {},
	"storage":     {},
	"replication": {"storage"},
	"uplink":      {},
	"config":      {"mqtt", "uplink"},
	"admin":       {"config", "mqtt", "replication", "uplink"},
	"cluster":     {"replication", "storage", "discovery", "config"},
	"daemon":      {"admin", "cluster", "config", "mqtt", "replication", "storage", "discovery", "uplink"},
	// The commands that work without a daemon use the packages below it
	// directly: inspect reads a stopped gateway's storage, peers browses
	// mDNS, passwd hashes as mqtt checks, bench and service use theirs;
	// cluster join and pair join check a token or code (cluster) before
	// they ask the daemon.
	"cli": {"daemon", "admin", "cluster", "config", "storage", "replication", "discovery", "mqtt", "bench", "packaging"},
}

// leaves import no package of ours, internal/ ones included.
var leaves = map[string]bool{"mqtt": true, "discovery": true}

// importers says who may import the packages that sit on top: cli only by
// main (the module root), daemon only by cli.
var importers = map[string][]string{
	"cli":    {""},
	"daemon": {"cli"},
}

type listedPackage struct {
	ImportPath  string
	Imports     []string
	TestImports []string
}

// TestImportRules fails when a package of the module imports one that
// DESIGN.md's layering forbids: what `go list` says each package imports,
// its tests' imports included for the packages on top.
func TestImportRules(t *testing.T) {
	out, err := exec.Command("go", "list", "-json=ImportPath,Imports,TestImports", "./...").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	seen := 0
	for {
		var p listedPackage
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		seen++
		self := ours(p.ImportPath)
		for _, imp := range p.Imports {
			if dep, ok := oursOK(imp); ok {
				checkImport(t, self, dep, false)
			}
		}
		for _, imp := range p.TestImports {
			if dep, ok := oursOK(imp); ok && dep != self {
				checkImport(t, self, dep, true)
			}
		}
		// An external test package (package x_test) is no part of x and
		// may import what it likes: daemon's links the command line in
		// (daemon/clilink_test.go).
	}
	if seen < 8 {
		t.Fatalf("go list found %d packages, want the whole module", seen)
	}
}

// checkImport reports self importing dep when a rule forbids it. Tests are
// held only to the importers rule: a test may use any package below it.
func checkImport(t *testing.T, self, dep string, test bool) {
	t.Helper()
	what := "imports"
	if test {
		what = "has tests that import"
	}
	if allowed, ok := importers[dep]; ok && !slices.Contains(allowed, self) {
		t.Errorf("%s %s %s: only %q may", name(self), what, dep, allowed)
	}
	if test {
		return
	}
	allowed, ok := importRules[self]
	if !ok {
		return
	}
	if strings.HasPrefix(dep, "internal/") && !leaves[self] {
		return
	}
	if !slices.Contains(allowed, dep) {
		t.Errorf("%s imports %s: DESIGN.md lets it import only %q", name(self), dep, allowed)
	}
}

// ours is path relative to the module ("" for the root).
func ours(path string) string {
	rel, _ := oursOK(path)
	return rel
}

func oursOK(path string) (string, bool) {
	if path == module {
		return "", true
	}
	rel, ok := strings.CutPrefix(path, module+"/")
	return rel, ok
}

func name(rel string) string {
	if rel == "" {
		return "main"
	}
	return rel
}
