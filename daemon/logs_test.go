package daemon

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// A gateway's start at the default level says what a person needs: no raw
// etcd raft lines, and at most one component per line (it was
// "component=peer component=peer" and "component=replication
// component=raft").
func TestStartLogsAreForPeople(t *testing.T) {
	var buf testutil.Buffer
	cfg := config.DefaultConfig()
	cfg.Node.DataDir, cfg.Node.Name = t.TempDir(), "test"
	cfg.MQTT.Listen, cfg.HTTP.Listen, cfg.Peer.Listen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	d, err := New(cfg, slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
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
