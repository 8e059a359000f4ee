package replication

import (
	"errors"
	"fmt"
)

// Sentinel errors a proposal's Done callback may receive; test with errors.Is.
var (
	// ErrAckTimeout means the record's ack rule was not met within
	// sync_timeout: for a sync topic, not enough slaves hold it. The record
	// may still be in the log (and be delivered); it was not acked.
	ErrAckTimeout = errors.New("replication: ack rule not met within sync_timeout")

	// ErrNoMaster means no master answered within sync_timeout (a slave
	// whose master is gone, a member cut off from the majority). Like any
	// ErrAckTimeout, which it is, the record was not acked and may still
	// be in the log if a dying master took it.
	ErrNoMaster error = noMaster{}

	// ErrNotLeader means this node cannot take proposals now (no master, or
	// it is not the master); the record was not logged.
	ErrNotLeader = errors.New("replication: not the master")

	// ErrStopped means the node stopped before the record met its ack rule.
	ErrStopped = errors.New("replication: stopped")

	// ErrStorage means the data file failed to take the record: it was
	// not logged and never will be (a record raft has taken when saves
	// start failing is answered by what becomes of its entry instead).
	ErrStorage = errors.New("replication: storage failure")

	// ErrLogFull means the log is over storage.max_bytes and holds only
	// records a member still lacks: the master takes no publishes until
	// that member catches up (or is removed). It is an ErrStorage.
	ErrLogFull = fmt.Errorf("%w: the log is over storage.max_bytes and a member still lacks its oldest records", ErrStorage)

	// ErrDiskLow means the data dir's filesystem has less free space than
	// storage.min_free: no publishes until space returns. It is an
	// ErrStorage.
	ErrDiskLow = fmt.Errorf("%w: free space on the data dir's filesystem is below storage.min_free", ErrStorage)

	// ErrIdentity means the data dir belongs to another node identity.
	ErrIdentity = errors.New("replication: data dir belongs to another node")
)

// noMaster is ErrNoMaster: its own words, and an ErrAckTimeout for errors.Is.
type noMaster struct{}

func (noMaster) Error() string        { return "replication: no master reachable within sync_timeout" }
func (noMaster) Is(target error) bool { return target == ErrAckTimeout }
