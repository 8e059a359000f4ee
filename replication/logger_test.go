package replication

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
)

// raft's role changes reach INFO in words a person reads; its other INFO
// lines go to DEBUG, as raft wrote them.
func TestRaftLoggerKeepsRoleChangesAtInfoAndTheRestAtDebug(t *testing.T) {
	var buf bytes.Buffer
	l := newRaftLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo})).With("component", "raft"))
	const id, peer = uint64(0xabc), uint64(0x1122334455667788)
	// What a lone gateway's raft says at start (etcd raft v3.6), then a
	// step down and a leadership transfer.
	l.Infof("newRaft %x [peers: [%s], term: %d, commit: %d, applied: %d, lastindex: %d, lastterm: %d]", id, "abc", 1, 1, 1, 1, 1)
	l.Infof(fmtBecameFollower, id, uint64(1)) // not a step down: DEBUG
	l.Infof("%x switched to configuration %s", id, "voters=(abc)")
	l.Infof("%x is starting a new election at term %d", id, uint64(1))
	l.Infof("%x became pre-candidate at term %d", id, uint64(1))
	l.Infof(fmtBecameCandidate, id, uint64(2))
	l.Infof("%x received %s from %x at term %d", id, "MsgVoteResp", id, uint64(2))
	l.Infof(fmtBecameLeader, id, uint64(2))
	l.Infof(fmtTransfer, id, uint64(2), peer)
	l.Infof(fmtBecameFollower, id, uint64(3)) // was leader: a step down
	l.Info("anything else")
	l.Warningf("%x stepped down to follower since quorum is not active", id)

	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	want := []string{
		`level=INFO msg="no master in sight: this gateway stands for election" component=raft term=2`,
		`level=INFO msg="this gateway won the election: it is the master" component=raft term=2`,
		`level=INFO msg="handing the master role over" component=raft to=11223344 term=2`,
		`level=INFO msg="this gateway is no longer the master: it follows the one the cluster elects" component=raft term=3`,
		`level=WARN msg="abc stepped down to follower since quorum is not active" component=raft`,
	}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines at INFO and above, want %d:\n%s", len(lines), len(want), buf.String())
	}
	for i, w := range want {
		if _, rest, _ := strings.Cut(lines[i], " "); rest != w { // drop time=
			t.Errorf("line %d:\n got %s\nwant %s", i, rest, w)
		}
	}

	// At DEBUG, the rest is there, formatted as raft meant it.
	buf.Reset()
	l = newRaftLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	l.Infof("%x switched to configuration %s", id, "voters=(abc)")
	if !strings.Contains(buf.String(), `level=DEBUG msg="abc switched to configuration voters=(abc)"`) {
		t.Errorf("debug: %s", buf.String())
	}
}
