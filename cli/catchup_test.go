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

// A joiner that installed the cluster's snapshot shows its catch-up as it
// goes (records pulled of the total, bytes, rate, ETA) and how it ended;
// the status it reads is a gateway's, served here on loopback.
func TestJoinShowsTheCatchUp(t *testing.T) {
	steps := []*admin.StatusCatchUp{
		{RecordsLeft: -1},
		{RecordsPulled: 100, BytesPulled: 300 << 10, RecordsLeft: 50},
		{RecordsPulled: 150, BytesPulled: 450 << 10, RecordsLeft: 0},
		nil,
	}
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := min(int(n.Add(1))-1, len(steps)-1)
		var st admin.Status
		st.Log.CatchUp = steps[i]
		st.Log.CatchingUp = steps[i] != nil
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
	go func() { done <- showCatchUp(&out, f) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the progress display did not end once the catch-up had")
	}
	got := out.String()
	for _, want := range []string{"asking the master", "caught up: 150 records (450.0 KiB) pulled from the master"} {
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
