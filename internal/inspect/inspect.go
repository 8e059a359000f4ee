// Package inspect prints a gateway's log as `tandem inspect` does: one JSON
// object per record (the contract's names), from a stopped gateway's data
// dir (Dir) or from the log of a running one (Write, which the daemon's
// GET /v1/log serves). It reads; it never changes the log.
package inspect

import (
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
	"unicode/utf8"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// Query says what of the log to print: from index From, at most Limit
// lines (0: all), conf changes too with All, payloads as Payload says
// (base64, text or hex: Encoders).
type Query struct {
	From, Limit uint64
	All         bool
	Payload     string
}

// Record is one line of `tandem inspect`.
type Record struct {
	Index   uint64 `json:"index"`
	Term    uint64 `json:"term"`
	Type    string `json:"type,omitempty"` // only with --all: "record", "control" or "conf_change"
	Kind    string `json:"kind,omitempty"` // a control record's kind (storage.Kind), with --all
	Topic   string `json:"topic,omitempty"`
	QoS     byte   `json:"qos"`
	Retain  bool   `json:"retain"`
	Payload string `json:"payload"` // standard base64, or as --payload asks
	// PayloadEncoding is set when the payload is not in the encoding
	// asked for: with --payload text, a payload that is not UTF-8 is
	// printed in base64 (JSON would garble it), and this says "base64".
	PayloadEncoding string `json:"payload_encoding,omitempty"`
	Client          string `json:"client"`
	Time            string `json:"time,omitempty"` // RFC 3339 with nanoseconds
	Origin          string `json:"origin,omitempty"`
	Seq             uint64 `json:"seq,omitempty"`
	PacketID        uint16 `json:"packet_id,omitempty"`
	Will            bool   `json:"will,omitempty"`
	Republished     bool   `json:"republished,omitempty"`
	// Aborted marks a sync record its master refused after logging it
	// (a settlement aborted it): no session or uplink ever gets it, and
	// its publisher was told it failed. Held marks one still waiting for
	// its settlement. Both as of the last record applied.
	Aborted bool `json:"aborted,omitempty"`
	Held    bool `json:"held,omitempty"`
	// Duplicate marks the second copy of a QoS 2 publish its device
	// resent on another member, whose original was committed late:
	// nobody gets it (mqtt: inboundDup).
	Duplicate bool          `json:"duplicate,omitempty"`
	Props     *inspectProps `json:"properties,omitempty"`
}

// inspectProps are a record's MQTT 5 properties as inspect prints them.
type inspectProps struct {
	PayloadFormat   *byte       `json:"payload_format,omitempty"`
	MessageExpiry   *uint32     `json:"message_expiry,omitempty"`
	ContentType     string      `json:"content_type,omitempty"`
	ResponseTopic   string      `json:"response_topic,omitempty"`
	CorrelationData []byte      `json:"correlation_data,omitempty"`
	User            [][2]string `json:"user,omitempty"`
}

func propsOf(p *storage.Properties) *inspectProps {
	if !p.PayloadFormatSet && !p.MessageExpirySet && p.ContentType == "" && p.ResponseTopic == "" && len(p.CorrelationData) == 0 && len(p.User) == 0 {
		return nil
	}
	out := &inspectProps{ContentType: p.ContentType, ResponseTopic: p.ResponseTopic, CorrelationData: p.CorrelationData}
	if p.PayloadFormatSet {
		out.PayloadFormat = &p.PayloadFormat
	}
	if p.MessageExpirySet {
		out.MessageExpiry = &p.MessageExpiry
	}
	for _, u := range p.User {
		out.User = append(out.User, [2]string{u.Key, u.Value})
	}
	return out
}

// Encoder returns a payload as inspect prints it, and the name of
// the encoding when it is not the one asked for.
type Encoder func([]byte) (string, string)

// Encoders are the --payload choices.
var Encoders = map[string]Encoder{
	"base64": func(b []byte) (string, string) { return base64.StdEncoding.EncodeToString(b), "" },
	"hex":    func(b []byte) (string, string) { return hex.EncodeToString(b), "" },
	"text": func(b []byte) (string, string) {
		if utf8.Valid(b) {
			return string(b), ""
		}
		return base64.StdEncoding.EncodeToString(b), "base64"
	},
}

// Dir opens dir read-only, never changing it, and prints its log. A data
// dir a running gateway holds gives storage.ErrInUse: ask that gateway
// (Write, behind GET /v1/log).
func Dir(w io.Writer, dir string, q Query) error {
	db, err := storage.Open(dir, &storage.Options{ReadOnly: true})
	if err != nil {
		return err
	}
	defer db.Close()
	return Write(w, db, q)
}

// Write prints q's part of db's log.
func Write(w io.Writer, db *storage.DB, q Query) error {
	payload, ok := Encoders[q.Payload]
	if !ok {
		if q.Payload != "" {
			return fmt.Errorf("payload encoding %q: base64, text or hex", q.Payload)
		}
		payload = Encoders["base64"]
	}
	from, limit, all := max(q.From, 1), q.Limit, q.All
	aborted, held, dups, err := mqtt.HoldState(sessions{db})
	if err != nil {
		return fmt.Errorf("reading the settled sync records: %w", err)
	}
	enc := json.NewEncoder(w)
	var n uint64
	var werr error
	err = db.Scan(from, func(e pb.Entry) bool {
		var out Record
		switch {
		case e.Type == pb.EntryNormal && len(e.Data) > 0:
			rec, err := storage.DecodeRecord(e.Data)
			if err != nil {
				werr = fmt.Errorf("entry %d: %w", e.Index, err)
				return false
			}
			if rec.Kind != storage.KindMessage && !all {
				return true // the gateway's own records: --all shows them
			}
			out = Record{
				Index: e.Index, Term: e.Term, Topic: rec.Topic, QoS: rec.QoS, Retain: rec.Retain,
				Client: rec.ClientID,
				Time:   time.Unix(0, rec.Time).UTC().Format(time.RFC3339Nano),
				Origin: replication.IDString(rec.Origin), Seq: rec.Seq, PacketID: rec.PacketID,
				Will: rec.Will, Republished: rec.Republished,
				Aborted: aborted[e.Index], Held: held[e.Index], Duplicate: dups[e.Index],
			}
			out.Payload, out.PayloadEncoding = payload(rec.Payload)
			out.Props = propsOf(&rec.Props)
			if all {
				out.Type = "record"
				if rec.Kind != storage.KindMessage {
					out.Type, out.Kind = "control", rec.Kind.String()
				}
			}
		case all && e.Type != pb.EntryNormal:
			out = Record{Index: e.Index, Term: e.Term, Type: "conf_change"}
		default:
			return true
		}
		if werr = enc.Encode(out); werr != nil {
			return false
		}
		n++
		return limit == 0 || n < limit
	})
	if err == nil {
		err = werr
	}
	if err == nil && n == 0 {
		err = nothingIn(db, from, all)
	}
	return err
}

// sessions reads the broker's session store in db (mqtt.SessionStore; the
// methods that write are never called).
type sessions struct{ db *storage.DB }

func (s sessions) Put(string, []byte) {}
func (s sessions) Delete(string)      {}
func (s sessions) Sync() error        { return nil }
func (s sessions) Load(prefix string, fn func(string, []byte) error) error {
	return s.db.ForEach(storage.BucketSessions, prefix, func(k, v []byte) error { return fn(string(k), v) })
}

// ErrNothing is what Write returns when it printed nothing: an empty
// answer always says why, and the CLI exits non-zero with it.
var ErrNothing = errors.New("no records printed")

// nothingIn says why a query from from printed no record.
func nothingIn(db *storage.DB, from uint64, all bool) error {
	first, err := db.FirstIndex()
	if err != nil {
		return err
	}
	last, err := db.LastIndex()
	if err != nil {
		return err
	}
	switch {
	case last == 0 || last < first:
		return fmt.Errorf("%w: the log holds none", ErrNothing)
	case from > last:
		return fmt.Errorf("%w: the log ends at index %d, before --from %d", ErrNothing, last, from)
	case all:
		return fmt.Errorf("%w: indexes %d to %d hold no entry this build can show", ErrNothing, max(from, first), last)
	default:
		return fmt.Errorf("%w: indexes %d to %d hold only the gateway's own records (--all shows them)", ErrNothing, max(from, first), last)
	}
}
