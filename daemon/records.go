package daemon

import (
	"log/slog"
	"sync"

	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// skips counts the records the applier could not read or apply and
// skipped (tandem_records_skipped_total{kind}). Every member skips the
// same record at the same index and goes on serving: a member stopped by
// its own log would be a bug (DESIGN.md, "The record").
type skips struct {
	log     *slog.Logger
	counted func(kind string) // the metric; nil in tests without one

	mu     sync.Mutex // guards logged
	logged map[uint64]bool
}

// maxLoggedSkips bounds the indexes skips remembers having logged: past
// it, a flood of unreadable records is counted, and logged again.
const maxLoggedSkips = 1024

// note counts the record at index as skipped and logs it once.
func (s *skips) note(index uint64, kind string, err error) {
	if s == nil {
		return
	}
	if s.counted != nil {
		s.counted(kind)
	}
	s.mu.Lock()
	seen := s.logged[index]
	if !seen {
		if len(s.logged) >= maxLoggedSkips {
			clear(s.logged)
		}
		s.logged[index] = true
	}
	s.mu.Unlock()
	if !seen {
		s.log.Warn("record skipped: it cannot be read or applied; every member skips it and goes on", "index", index, "kind", kind, "error", err)
	}
}

func newSkips(log *slog.Logger, counted func(string)) *skips {
	return &skips{log: log, counted: counted, logged: map[uint64]bool{}}
}

// controlRecord is one of the gateway's own records of kind, from node n:
// in the header's encoding once the cluster's feature level allows it,
// else on its legacy topic, which every member's build reads.
func controlRecord(n *replication.Node, kind storage.Kind, client string, payload []byte) storage.Record {
	return storage.Record{
		Kind: kind, Legacy: n.LegacyControl(),
		Origin: n.ID(), Seq: n.NextSeq(), ClientID: client, Topic: kind.LegacyTopic(),
		Time: clock.Now().UnixNano(), Payload: payload,
	}
}
