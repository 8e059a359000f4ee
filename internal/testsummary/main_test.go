package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A run with a pass, a skip with its reason, a failure and a package that
// did not build, as go test -json (Go 1.24 and later) writes them.
const sample = `{"Action":"start","Package":"github.com/tandem-edge/tandem/a"}
{"Action":"run","Package":"github.com/tandem-edge/tandem/a","Test":"TestOK"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Test":"TestOK","Output":"=== RUN   TestOK\n"}
{"Action":"pass","Package":"github.com/tandem-edge/tandem/a","Test":"TestOK"}
{"Action":"run","Package":"github.com/tandem-edge/tandem/a","Test":"TestAvahi"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Test":"TestAvahi","Output":"=== RUN   TestAvahi\n"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Test":"TestAvahi","Output":"    avahi_test.go:12: avahi-daemon not installed (apt-get install avahi-daemon)\n"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Test":"TestAvahi","Output":"--- SKIP: TestAvahi (0.00s)\n"}
{"Action":"skip","Package":"github.com/tandem-edge/tandem/a","Test":"TestAvahi"}
{"Action":"run","Package":"github.com/tandem-edge/tandem/a","Test":"TestBroken"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Test":"TestBroken","Output":"=== RUN   TestBroken\n"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Test":"TestBroken","Output":"    a_test.go:30: got 1, want 2\n"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Test":"TestBroken","Output":"--- FAIL: TestBroken (0.00s)\n"}
{"Action":"fail","Package":"github.com/tandem-edge/tandem/a","Test":"TestBroken"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Output":"FAIL\n"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/a","Output":"FAIL\tgithub.com/tandem-edge/tandem/a\t0.01s\n"}
{"Action":"fail","Package":"github.com/tandem-edge/tandem/a"}
{"ImportPath":"github.com/tandem-edge/tandem/b","Action":"build-output","Output":"b/b.go:3:1: syntax error\n"}
{"ImportPath":"github.com/tandem-edge/tandem/b","Action":"build-fail"}
{"Action":"start","Package":"github.com/tandem-edge/tandem/b"}
{"Action":"fail","Package":"github.com/tandem-edge/tandem/b","FailedBuild":"github.com/tandem-edge/tandem/b"}
`

func TestSummaryCountsAndListsSkipsWithReasons(t *testing.T) {
	var out strings.Builder
	s, err := scan(strings.NewReader(sample), &out)
	if err != nil {
		t.Fatal(err)
	}
	s.print(&out)
	got := out.String()
	for _, want := range []string{
		"a_test.go:30: got 1, want 2",   // the failure's log is shown
		"b/b.go:3:1: syntax error",      // and the build error
		"1 passed, 1 failed, 1 skipped", // the summary line
		"skipped a.TestAvahi: avahi_test.go:12: avahi-daemon not installed (apt-get install avahi-daemon)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "=== RUN") {
		t.Errorf("output shows -v progress lines:\n%s", got)
	}
	if !s.failed() {
		t.Error("a failed test and a failed build: failed() = false")
	}
}

func TestSummaryPassesOnlyWhenEverythingPassed(t *testing.T) {
	const ok = `{"Action":"start","Package":"p"}
{"Action":"run","Package":"p","Test":"TestA"}
{"Action":"pass","Package":"p","Test":"TestA"}
{"Action":"run","Package":"p","Test":"TestB"}
{"Action":"output","Package":"p","Test":"TestB","Output":"--- SKIP: TestB (0.00s)\n"}
{"Action":"skip","Package":"p","Test":"TestB"}
{"Action":"output","Package":"p","Output":"PASS\n"}
{"Action":"pass","Package":"p"}
`
	var out strings.Builder
	s, err := scan(strings.NewReader(ok), &out)
	if err != nil {
		t.Fatal(err)
	}
	if s.failed() {
		t.Error("all passed or skipped: failed() = true")
	}
	// go test that died before any package (a bad flag) must not
	// read as success.
	s, err = scan(strings.NewReader("flag provided but not defined: -bogus\n"), &out)
	if err != nil {
		t.Fatal(err)
	}
	if !s.failed() {
		t.Error("no package seen: failed() = false")
	}
}

func TestReportSumsRecordedRuns(t *testing.T) {
	path := filepath.Join(t.TempDir(), "record")
	for range 2 { // as make test's plain and race runs
		s, err := scan(strings.NewReader(sample), new(strings.Builder))
		if err != nil {
			t.Fatal(err)
		}
		if err := appendRecord(path, s); err != nil {
			t.Fatal(err)
		}
	}
	s, err := readRecord(path)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	s.print(&out)
	got := out.String()
	if !strings.HasPrefix(got, "2 passed, 2 failed, 2 skipped (2 go test runs); 2 package(s) failed") {
		t.Errorf("report:\n%s", got)
	}
	if n := strings.Count(got, "skipped a.TestAvahi"); n != 1 {
		t.Errorf("a test skipped in both runs listed %d times:\n%s", n, got)
	}
	if !s.failed() {
		t.Error("failed() = false")
	}
	if _, err := readRecord(filepath.Join(t.TempDir(), "none")); !os.IsNotExist(err) {
		t.Errorf("missing record: %v", err)
	}
}

// A test binary that dies mid-test (a panic in a goroutine, a signal)
// leaves tests that never pass or fail: their output, the panic among it,
// is shown with the package's failure, not lost.
func TestSummaryShowsTheOutputOfTestsADyingBinaryLeftUnfinished(t *testing.T) {
	const died = `{"Action":"start","Package":"github.com/tandem-edge/tandem/c"}
{"Action":"run","Package":"github.com/tandem-edge/tandem/c","Test":"TestFine"}
{"Action":"pass","Package":"github.com/tandem-edge/tandem/c","Test":"TestFine"}
{"Action":"run","Package":"github.com/tandem-edge/tandem/c","Test":"TestDies"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/c","Test":"TestDies","Output":"=== RUN   TestDies\n"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/c","Test":"TestDies","Output":"panic: boom in a goroutine\n"}
{"Action":"output","Package":"github.com/tandem-edge/tandem/c","Output":"FAIL\tgithub.com/tandem-edge/tandem/c\t1.0s\n"}
{"Action":"fail","Package":"github.com/tandem-edge/tandem/c"}
`
	var out strings.Builder
	s, err := scan(strings.NewReader(died), &out)
	if err != nil {
		t.Fatal(err)
	}
	s.print(&out)
	if got := out.String(); !strings.Contains(got, "panic: boom in a goroutine") || !strings.Contains(got, "unfinished: TestDies") {
		t.Errorf("the dying test's output is not shown:\n%s", got)
	}
	if !s.failed() {
		t.Error("a package whose binary died: failed() = false")
	}
}
