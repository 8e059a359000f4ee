// Command testsummary reads `go test -json` on stdin, prints what a plain
// `go test` would (a line per package, the output of the tests that
// failed, build errors) and ends with one line, `N passed, M failed, K
// skipped`, followed by every skipped test and the reason it gave. A
// plain `go test` shows skips only with -v, so a suite can print `ok`
// while the tests that need avahi, lintian or systemd never ran; this
// makes them visible in `make test` without a new dependency (gotestsum
// does the same, but we need a tenth of it).
//
// It exits 1 when any test or package failed, when a package did not
// build, or when it saw no package at all (go test died before running
// anything): the exit status of `go test -json | testsummary` is the
// tool's, since sh has no pipefail, so it must fail whenever go test would.
//
// With -record FILE it also appends this run's results to FILE; with
// -report FILE (and nothing on stdin) it prints the summary of every run
// recorded there, so that `make test`, which runs go test several times
// (plain, race, fuzz, ARM), ends with one summary of them all.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// event is one line of `go test -json` (cmd/test2json's TestEvent; the
// build-output and build-fail actions carry ImportPath instead).
type event struct {
	Action      string
	Package     string
	Test        string
	Output      string
	ImportPath  string
	FailedBuild string
}

// result is one finished test, as -record writes it and -report reads it.
type result struct {
	Package string `json:"package"`
	Test    string `json:"test"`
	Action  string `json:"action"` // pass, fail or skip
	Reason  string `json:"reason,omitempty"`
}

// summary is what one or more runs came to.
type summary struct {
	results     []result
	packages    int // packages seen (started or failed to build)
	pkgFailures int // packages that failed outside any one test (build, panic in TestMain, timeout)
	// testFailed holds the packages in which a test failed, whose own
	// failure that explains (scan only).
	testFailed map[string]bool
	runs       int  // runs recorded, for -report
	bad        bool // input that cannot be trusted: no package seen
}

func main() {
	record := flag.String("record", "", "also append this run's results to `FILE`")
	report := flag.String("report", "", "print the summary of every run recorded in `FILE` and exit")
	flag.Parse()
	if *report != "" {
		s, err := readRecord(*report)
		if err != nil {
			fmt.Fprintln(os.Stderr, "testsummary:", err)
			os.Exit(1)
		}
		s.print(os.Stdout)
		if s.failed() {
			os.Exit(1)
		}
		return
	}
	s, err := scan(os.Stdin, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testsummary:", err)
		os.Exit(1)
	}
	if *record != "" {
		if err := appendRecord(*record, s); err != nil {
			fmt.Fprintln(os.Stderr, "testsummary:", err)
			os.Exit(1)
		}
	}
	s.print(os.Stdout)
	if s.failed() {
		os.Exit(1)
	}
}

// scan reads go test -json from r, echoes to w what go test without -json
// would have shown, and returns the results.
func scan(r io.Reader, w io.Writer) (*summary, error) {
	s := &summary{runs: 1, testFailed: map[string]bool{}}
	out := map[[2]string][]string{} // output so far of each running test
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20) // a test may log long lines
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &e) != nil {
			// Not an event: go's own messages (a download, a vet
			// error) pass through as they are.
			fmt.Fprintf(w, "%s\n", line)
			continue
		}
		switch {
		case e.Action == "build-output":
			fmt.Fprint(w, e.Output)
		case e.Action == "build-fail":
			s.packages++
			s.pkgFailures++
		case e.Test == "":
			if e.Action == "fail" {
				// A test binary that died (a panic, a signal, os.Exit)
				// ends tests that never pass or fail: their output is
				// the only account of it.
				for key, o := range out {
					if key[0] == e.Package {
						fmt.Fprintf(w, "--- unfinished: %s\n", key[1])
						for _, l := range o {
							if !strings.HasPrefix(l, "=== ") {
								fmt.Fprint(w, l)
							}
						}
						delete(out, key)
					}
				}
			}
			s.packageEvent(e, w)
		default:
			key := [2]string{e.Package, e.Test}
			switch e.Action {
			case "output":
				out[key] = append(out[key], e.Output)
			case "pass", "fail", "skip":
				res := result{Package: e.Package, Test: e.Test, Action: e.Action}
				if e.Action == "skip" {
					res.Reason = skipReason(out[key])
				}
				if e.Action == "fail" {
					s.testFailed[e.Package] = true
					// What go test shows of a failure: its log,
					// without the progress lines -v adds.
					for _, o := range out[key] {
						if !strings.HasPrefix(o, "=== ") {
							fmt.Fprint(w, o)
						}
					}
				}
				delete(out, key)
				s.results = append(s.results, res)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading go test -json: %w", err)
	}
	if s.packages == 0 {
		s.bad = true
	}
	return s, nil
}

// packageEvent handles an event of a package rather than of a test.
func (s *summary) packageEvent(e event, w io.Writer) {
	switch e.Action {
	case "start":
		s.packages++
	case "output":
		// "PASS" alone is the -v footer; go test without -v prints
		// only the "ok  pkg  0.1s" line after it.
		if e.Output != "PASS\n" {
			fmt.Fprint(w, e.Output)
		}
	case "fail":
		if e.FailedBuild != "" || s.testFailed[e.Package] {
			return // counted at build-fail, or as its tests' failures
		}
		s.pkgFailures++
	}
}

// skipReason is what a skipped test said before t.Skip returned: its log
// lines, without the "=== RUN" and "--- SKIP" lines test2json frames them
// with.
func skipReason(lines []string) string {
	var parts []string
	for _, l := range lines {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "=== ") || strings.HasPrefix(l, "--- ") {
			continue
		}
		parts = append(parts, l)
	}
	if len(parts) == 0 {
		return "(no reason given)"
	}
	return strings.Join(parts, " ")
}

func (s *summary) failed() bool {
	if s.bad || s.pkgFailures > 0 {
		return true
	}
	for _, r := range s.results {
		if r.Action == "fail" {
			return true
		}
	}
	return false
}

// print writes the summary line and the skipped tests. A test skipped in
// several runs (plain and race) is listed once.
func (s *summary) print(w io.Writer) {
	var passed, failed, skipped int
	type skip struct{ name, reason string }
	var skips []skip
	seen := map[string]bool{}
	for _, r := range s.results {
		switch r.Action {
		case "pass":
			passed++
		case "fail":
			failed++
		case "skip":
			skipped++
			name := shortPkg(r.Package) + "." + r.Test
			if !seen[name] {
				seen[name] = true
				skips = append(skips, skip{name, r.Reason})
			}
		}
	}
	sort.Slice(skips, func(i, j int) bool { return skips[i].name < skips[j].name })
	line := fmt.Sprintf("%d passed, %d failed, %d skipped", passed, failed, skipped)
	if s.runs > 1 {
		line += fmt.Sprintf(" (%d go test runs)", s.runs)
	}
	if s.pkgFailures > 0 {
		line += fmt.Sprintf("; %d package(s) failed to build or run", s.pkgFailures)
	}
	if s.bad {
		line += "; no test package ran (see go's errors above)"
	}
	fmt.Fprintln(w, line)
	for _, k := range skips {
		fmt.Fprintf(w, "  skipped %s: %s\n", k.name, k.reason)
	}
}

// shortPkg drops the module path, which every package shares.
func shortPkg(p string) string {
	return strings.TrimPrefix(strings.TrimPrefix(p, "github.com/tandem-edge/tandem"), "/")
}

// appendRecord appends s to the record file: one header line per run,
// then one line per result.
func appendRecord(path string, s *summary) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(f)
	hdr := map[string]any{"run": true, "packages": s.packages, "package_failures": s.pkgFailures, "bad": s.bad}
	if err := enc.Encode(hdr); err != nil {
		f.Close()
		return err
	}
	for _, r := range s.results {
		if err := enc.Encode(r); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}

// readRecord reads what appendRecord wrote, over every run.
func readRecord(path string) (*summary, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	s := &summary{}
	dec := json.NewDecoder(f)
	for {
		var m struct {
			Run             bool `json:"run"`
			Packages        int  `json:"packages"`
			PackageFailures int  `json:"package_failures"`
			Bad             bool `json:"bad"`
			result
		}
		if err := dec.Decode(&m); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if m.Run {
			s.runs++
			s.packages += m.Packages
			s.pkgFailures += m.PackageFailures
			s.bad = s.bad || m.Bad
			continue
		}
		s.results = append(s.results, m.result)
	}
	if s.runs == 0 {
		return nil, fmt.Errorf("%s: no run recorded", path)
	}
	return s, nil
}
