package daemon_test

import (
	"bufio"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// A gateway with little to do runs on one Go processor, which spares it
// the second thread's wake-ups after every message (internal/procs); an
// operator's GOMAXPROCS is kept as given. go_sched_gomaxprocs_threads on
// /metrics says which.
func TestIdleGatewayRunsOnOneProcessorUnlessGOMAXPROCSIsSet(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("one CPU: there is no second processor to spare (needs a host with 2 CPUs)")
	}
	for _, tc := range []struct {
		name, env string
		want      string
		log       string
	}{
		{"governed", "", "1", "processors: one while the load needs less than a core"},
		{"GOMAXPROCS=2", "2", "2", "GOMAXPROCS is set in the environment"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("GOMAXPROCS", tc.env)
			p := startTandem(t, t.TempDir(), nil)
			testutil.WaitFor(t, 10*time.Second, "the processors' log line", func() bool {
				return strings.Contains(p.out.String(), tc.log)
			}, p.out.String)
			if got := gaugeLine(t, p.addrs.http, "go_sched_gomaxprocs_threads"); got != tc.want {
				t.Errorf("go_sched_gomaxprocs_threads = %q, want %q", got, tc.want)
			}
			if code := p.stop(10 * time.Second); code != 0 {
				t.Errorf("exit code %d after SIGTERM, want 0\n%s", code, p.out.Tail(2000))
			}
		})
	}
}

// gaugeLine is the value of the unlabelled sample name on the /metrics of
// the gateway whose HTTP API is at addr, as written there.
func gaugeLine(t *testing.T, addr, name string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			return v
		}
	}
	t.Fatalf("no %s on /metrics (%v)", name, sc.Err())
	return ""
}
