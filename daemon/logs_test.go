package daemon

import (
	"strings"
	"testing"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// A gateway's start at the default level says what a person needs: no raw
// etcd raft lines, and at most one component per line (it was
// "component=peer component=peer" and "component=replication
// component=raft").
func TestStartLogsAreForPeople(t *testing.T) {
	var buf testutil.Buffer
	d := startGatewayIn(t, t.TempDir(), nil, &buf)
	d.Stop()
	out := buf.String()
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if n := strings.Count(line, " component="); n > 1 {
			t.Errorf("%d components: %s", n, line)
		}
		for _, raw := range []string{"newRaft", "switched to configuration", "became pre-candidate", "MsgVote", "MsgPreVote"} {
			if strings.Contains(line, raw) {
				t.Errorf("raw raft line at INFO: %s", line)
			}
		}
	}
	if !strings.Contains(out, "this gateway won the election: it is the master") || !strings.Contains(out, "gateway started") {
		t.Errorf("the start does not say this gateway is the master:\n%s", out)
	}
}
