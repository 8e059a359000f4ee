package replication

import (
	"fmt"
	"log/slog"
	"os"
)

// raftLogger adapts slog to raft.Logger, so raft's messages land in the
// daemon's log with the node's other lines.
type raftLogger struct{ l *slog.Logger }

func (r raftLogger) Debug(v ...any)              { r.l.Debug(fmt.Sprint(v...)) }
func (r raftLogger) Debugf(f string, v ...any)   { r.l.Debug(fmt.Sprintf(f, v...)) }
func (r raftLogger) Info(v ...any)               { r.l.Info(fmt.Sprint(v...)) }
func (r raftLogger) Infof(f string, v ...any)    { r.l.Info(fmt.Sprintf(f, v...)) }
func (r raftLogger) Warning(v ...any)            { r.l.Warn(fmt.Sprint(v...)) }
func (r raftLogger) Warningf(f string, v ...any) { r.l.Warn(fmt.Sprintf(f, v...)) }
func (r raftLogger) Error(v ...any)              { r.l.Error(fmt.Sprint(v...)) }
func (r raftLogger) Errorf(f string, v ...any)   { r.l.Error(fmt.Sprintf(f, v...)) }
func (r raftLogger) Fatal(v ...any)              { r.fatal(fmt.Sprint(v...)) }
func (r raftLogger) Fatalf(f string, v ...any)   { r.fatal(fmt.Sprintf(f, v...)) }
func (r raftLogger) Panic(v ...any)              { r.panic(fmt.Sprint(v...)) }
func (r raftLogger) Panicf(f string, v ...any)   { r.panic(fmt.Sprintf(f, v...)) }
func (r raftLogger) fatal(msg string)            { r.l.Error("raft: " + msg); os.Exit(1) }
func (r raftLogger) panic(msg string)            { r.l.Error("raft: " + msg); panic(msg) }
func discard() *slog.Logger                      { return slog.New(slog.DiscardHandler) }
