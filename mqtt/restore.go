package mqtt

import (
	"encoding/binary"
	"fmt"
	"strings"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// Snapshots of the broker state.
//
// A member far behind the log (a joiner to a compacted log, a slave away
// for long) is brought up to date with a snapshot of the master's data
// file instead of the records retention dropped (storage/snapshot.go). The
// session store's part of it is what SnapshotSessions writes: the state a
// member that applied the whole log would hold for sessions that live
// elsewhere. Restore then replaces this broker's state with it.

// codeRestore ends the connections of a member that takes in a snapshot:
// their sessions are replaced under them. They reconnect and find the
// cluster's state.
var codeRestore = packets.ErrServerBusy

// restoreWhy is the reason string of codeRestore.
const restoreWhy = "this gateway is taking in the cluster's state; connect again"

// restoreWait bounds how long Restore waits for the connections it ended
// to go.
const restoreWait = 2 * time.Second

// SnapshotSessions writes the session store's part of a snapshot, in the
// shape of storage.SnapshotConverter: scan reads the store's keys with a
// prefix, emit writes a key into the snapshot. It carries sessions,
// subscriptions, retained messages, QoS 2 inbound markers and released
// QoS 2 flows as they are. It leaves out the messages in flight to a
// connection of this member that the device has not acknowledged (their
// packet ids belong to that connection's flow; another member would not
// know whether the device got them), and lowers that session's cursor to
// below the oldest of them, as the cursors replicated for the other
// members are (ackedCursorLocked): where the session resumes elsewhere, it
// gets them again.
func SnapshotSessions(scan func(prefix string, fn func(k, v []byte) error) error, emit func(k, v []byte) error) error {
	low := map[string]uint64{} // per session: the cursor below its unacknowledged messages
	err := scan(keyOut, func(k, v []byte) error {
		id, _, ok := splitKey(string(k), keyOut)
		it, err := decodeOut(v)
		if !ok || err != nil || it.rel || it.idx == 0 {
			return nil
		}
		if cur, seen := low[id]; !seen || it.idx-1 < cur {
			low[id] = it.idx - 1
		}
		return nil
	})
	if err != nil {
		return err
	}
	return scan("", func(k, v []byte) error {
		key := string(k)
		switch {
		case strings.HasPrefix(key, keyOut):
			if it, err := decodeOut(v); err != nil || !it.rel {
				return nil // unacknowledged here: resent from the cursor
			}
		case strings.HasPrefix(key, keyCursor) && len(v) == 8:
			if l, ok := low[key[len(keyCursor):]]; ok && l < binary.BigEndian.Uint64(v) {
				return emit(k, binary.BigEndian.AppendUint64(nil, l))
			}
		}
		return emit(k, v)
	})
}

// Restore replaces the broker's sessions and retained messages with those
// of a snapshot: the applier calls it, in log order, when a snapshot
// replaces the log (index is the snapshot's). It ends the connections this
// member serves (MQTT 5 clients get DISCONNECT 0x89 with a reason; they
// reconnect and find the new state), waits for them to go, calls install,
// which replaces the data file's log and broker state, and loads the
// sessions and retained messages from the store as Start does. New
// connections wait for it.
func (s *Server) Restore(index uint64, install func() error) error {
	conns := s.onlineConns()
	for _, c := range conns {
		c.endTo(codeRestore, "", restoreWhy)
	}
	t := time.NewTimer(restoreWait)
	defer t.Stop()
wait:
	for _, c := range conns {
		select {
		case <-c.done:
		case <-t.C:
			s.lines.Warn("connections still open while the cluster's state is installed", "clients", len(s.onlineConns()))
			break wait
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := install(); err != nil {
		return err
	}
	var late []*conn
	for id, se := range s.sessions {
		se.mu.Lock()
		if se.conn != nil {
			// Connected since the connections above were ended, or
			// slow to go: it ends too, on a session that is no more.
			late = append(late, se.conn)
		}
		subs := se.subs
		// A connection still going detaches from nothing: its session
		// is no longer the server's (detach checks se.conn).
		se.ended, se.conn, se.subs = true, nil, map[string]*subscription{}
		se.on.Store(false)
		s.recountLocked(se) // to 0: the snapshot's are counted as loaded
		se.mu.Unlock()
		for _, sub := range subs {
			s.index.remove(se, sub)
		}
		delete(s.sessions, id)
	}
	s.refs = nil
	for _, c := range late {
		c.endTo(codeRestore, "", restoreWhy)
	}
	for id, w := range s.wills {
		s.dropWillLocked(id, w)
	}
	s.retained.reset()
	s.retained.dropPending()
	s.inflight.Store(0)
	s.skipMu.Lock()
	s.skip = nil
	s.skipMu.Unlock()
	s.setApplied(index)
	s.holds.mu.Lock()
	s.holds.waiting = nil // sessions that are no more; loadState reads the snapshot's holds
	s.holds.pending = nil // acks of connections ended above, to sessions that are no more
	s.holds.mu.Unlock()
	if err := s.loadState(false); err != nil {
		return fmt.Errorf("mqtt: loading the sessions of the snapshot: %w", err)
	}
	s.lines.Info("took in the cluster's sessions and retained messages from a snapshot", "index", index,
		"sessions", len(s.sessions), "retained", s.retained.len(), "clients_ended", len(conns))
	return nil
}
