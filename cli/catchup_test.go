package cli

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/admin"
)

// A joiner shows how it takes in the cluster's history: the log up to the
// master's commit index when it was taken in (here a snapshot), then the
// records before the snapshot as they are pulled (records of the total,
// bytes, rate, ETA), and how it ended; the status it reads is a gateway's,
// served here on loopback.
func TestJoinShowsTheCatchUp(t *testing.T) {
	type step struct {
		applied uint64
		c       *admin.StatusCatchUp
	}
	steps := []step{
		{0, nil}, // the snapshot not in yet
		{5000, &admin.StatusCatchUp{RecordsLeft: -1}}, // installed; asking
		{5010, &admin.StatusCatchUp{RecordsPulled: 100, BytesPulled: 300 << 10, RecordsLeft: 50}},
		{5020, &admin.StatusCatchUp{RecordsPulled: 150, BytesPulled: 450 << 10, RecordsLeft: 0}},
		{5030, nil},
	}
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := min(int(n.Add(1))-1, len(steps)-1)
		var st admin.Status
		st.Log.AppliedIndex = steps[i].applied
		st.Log.CatchUp = steps[i].c
		st.Log.CatchingUp = steps[i].c != nil
		_ = json.NewEncoder(w).Encode(st)
	}))
	defer srv.Close()
	tok := filepath.Join(t.TempDir(), "http-token")
	if err := os.WriteFile(tok, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	f := &apiFlags{http: strings.TrimPrefix(srv.URL, "http://"), tokenFile: tok}
	var out bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- showCatchUp(&out, f, 4000) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the progress display did not end once the catch-up had")
	}
	got := out.String()
	for _, want := range []string{"taking in the cluster's log", "index 0 of 4000", "caught up: 150 records (450.0 KiB) pulled from the master"} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
}

func TestCatchUpLine(t *testing.T) {
	line := catchUpText(admin.StatusCatchUp{RecordsPulled: 100, BytesPulled: 2 << 20, RecordsLeft: 300}, 2*time.Second)
	for _, want := range []string{"[######..................]", " 25% 100/400 records", "2.0 MiB", "1.0 MiB/s", "ETA 6s"} {
		if !strings.Contains(line, want) {
			t.Errorf("%q lacks %q", line, want)
		}
	}
}

// A joiner whose history is already in (a voter of three, caught up
// before join answered) prints nothing more.
func TestJoinCaughtUpAlreadySaysNothingMore(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var st admin.Status
		st.Log.AppliedIndex = 12
		_ = json.NewEncoder(w).Encode(st)
	}))
	defer srv.Close()
	tok := filepath.Join(t.TempDir(), "http-token")
	if err := os.WriteFile(tok, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := showCatchUp(&out, &apiFlags{http: strings.TrimPrefix(srv.URL, "http://"), tokenFile: tok}, 10); err != nil || out.Len() != 0 {
		t.Fatalf("showCatchUp = %v, printed %q", err, out.String())
	}
}
