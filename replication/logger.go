package replication

import (
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
)

// raftLogger adapts slog to raft.Logger, so raft's messages land in the
// daemon's log with the node's other lines. etcd raft logs at INFO what
// only a raft developer reads (about 16 lines at every start: newRaft,
// configurations, votes sent and received); an installer reading the
// journal wants to know when this gateway became or stopped being the
// master and when it stood for election. So the few lines that say that
// are reworded and kept at INFO, and every other INFO line goes to DEBUG
// as raft wrote it. Warnings and errors stay as they are.
//
// raft calls it from the node's one goroutine, but the leader flag is
// atomic so that a logger shared by a test's nodes stays race-free.
type raftLogger struct {
	l      *slog.Logger
	leader atomic.Bool // this node's last reported role was leader
}

func newRaftLogger(l *slog.Logger) *raftLogger { return &raftLogger{l: l} }

func (r *raftLogger) Debug(v ...any)              { r.l.Debug(fmt.Sprint(v...)) }
func (r *raftLogger) Debugf(f string, v ...any)   { r.l.Debug(fmt.Sprintf(f, v...)) }
func (r *raftLogger) Info(v ...any)               { r.l.Debug(fmt.Sprint(v...)) }
func (r *raftLogger) Infof(f string, v ...any)    { r.infof(f, v...) }
func (r *raftLogger) Warning(v ...any)            { r.l.Warn(fmt.Sprint(v...)) }
func (r *raftLogger) Warningf(f string, v ...any) { r.l.Warn(fmt.Sprintf(f, v...)) }
func (r *raftLogger) Error(v ...any)              { r.l.Error(fmt.Sprint(v...)) }
func (r *raftLogger) Errorf(f string, v ...any)   { r.l.Error(fmt.Sprintf(f, v...)) }
func (r *raftLogger) Fatal(v ...any)              { r.fatal(fmt.Sprint(v...)) }
func (r *raftLogger) Fatalf(f string, v ...any)   { r.fatal(fmt.Sprintf(f, v...)) }
func (r *raftLogger) Panic(v ...any)              { r.panic(fmt.Sprint(v...)) }
func (r *raftLogger) Panicf(f string, v ...any)   { r.panic(fmt.Sprintf(f, v...)) }
func (r *raftLogger) fatal(msg string)            { r.l.Error("raft: " + msg); os.Exit(1) }
func (r *raftLogger) panic(msg string)            { r.l.Error("raft: " + msg); panic(msg) }
func discard() *slog.Logger                       { return slog.New(slog.DiscardHandler) }

// The format strings of etcd raft v3.6's role changes, which raft passes
// to Infof with (id, term) or (id, term, peer). Matching the format, not
// the formatted text, keeps this exact; a raft upgrade that rewords one
// only sends it to DEBUG.
const (
	fmtBecameLeader    = "%x became leader at term %d"
	fmtBecameCandidate = "%x became candidate at term %d"
	fmtBecameFollower  = "%x became follower at term %d"
	fmtTimeoutNow      = "%x [term %d] received MsgTimeoutNow from %x and starts an election to get leadership."
	fmtTransfer        = "%x [term %d] starts to transfer leadership to %x"
)

// infof words raft's role changes for a person and sends the rest to
// DEBUG.
func (r *raftLogger) infof(format string, v ...any) {
	term := func() any {
		if len(v) > 1 {
			return v[1]
		}
		return nil
	}
	switch format {
	case fmtBecameLeader:
		r.leader.Store(true)
		r.l.Info("this gateway won the election: it is the master", "term", term())
		return
	case fmtBecameCandidate:
		// After a successful pre-vote only (pre-candidates go to
		// DEBUG): a real election, which bumps the term.
		r.l.Info("no master in sight: this gateway stands for election", "term", term())
		return
	case fmtBecameFollower:
		if r.leader.Swap(false) {
			r.l.Info("this gateway is no longer the master: it follows the one the cluster elects", "term", term())
			return
		}
	case fmtTimeoutNow:
		r.l.Info("the master hands over: this gateway stands for election", "term", term())
		return
	case fmtTransfer:
		if len(v) > 2 {
			if id, ok := v[2].(uint64); ok {
				r.l.Info("handing the master role over", "to", ShortID(id), "term", term())
				return
			}
		}
	}
	r.l.Debug(fmt.Sprintf(format, v...))
}
