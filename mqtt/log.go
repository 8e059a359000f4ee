package mqtt

// Log is what the server needs of the replicated log to take publishes.
type Log interface {
	// Reserve gives m its record id (m.Origin, m.Seq) ahead of Propose, so
	// state that names the record can be staged before the record exists.
	Reserve(m *Message)
	// Propose logs m, whose id Reserve set, under mode. done.Done is
	// called exactly once, when the record meets mode's ack rule (nil) or
	// cannot (an error, ErrQuota for lack of space). It must not block.
	// m itself is not the Log's after Propose returns (it may be reused);
	// what it points to does not change.
	Propose(m *Message, mode AckMode, done Done)
	// Logged reports which of the given sequence numbers of records from
	// origin are in the log.
	Logged(origin uint64, seqs []uint64) (map[uint64]bool, error)
}

// Done receives the outcome of a Log.Propose. An interface rather than a
// func: a publish's ack is its own Done, where a func would be a method
// value, one allocation more per publish.
type Done interface {
	Done(err error)
}

// DoneFunc is a func as a Done.
type DoneFunc func(err error)

// Done calls f.
func (f DoneFunc) Done(err error) { f(err) }

// Clustered is a Log that knows whether other members share it. On a Log
// without other members (a lone gateway, or a Log without this method)
// nobody can take a device's session over, so QoS 2 deliveries need no
// release records (qos2.go).
type Clustered interface {
	// OtherMembers reports whether the log has members besides this one.
	OtherMembers() bool
}

// ControlEncoding is a Log that knows whether every member reads the
// encodings of control records from feature level 2 on (compact cursor
// records, cursors.go). A Log without it has no members of earlier builds.
type ControlEncoding interface {
	// LegacyControl reports whether control records are written as
	// builds before feature level 2 read them.
	LegacyControl() bool
}

// SessionStore keeps the server's persistent state: sessions of clients
// that asked for one (subscriptions, cursor, messages in flight by log
// index, inbound QoS 2 markers) and retained messages. The daemon backs it
// with the data file, where Put and Delete are staged and become durable
// with the next log commit.
type SessionStore interface {
	// Put stages key=value. value is not modified afterwards.
	Put(key string, value []byte)
	// Delete stages the removal of key.
	Delete(key string)
	// Sync makes everything staged so far durable before it returns.
	Sync() error
	// Load calls fn for every key with prefix, in key order.
	Load(prefix string, fn func(key string, value []byte) error) error
}
