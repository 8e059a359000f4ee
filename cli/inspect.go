package cli

import (
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// InspectRecord is one line of `tandem inspect`.
type InspectRecord struct {
	Index   uint64 `json:"index"`
	Term    uint64 `json:"term"`
	Type    string `json:"type,omitempty"` // only with --all: "record" or "conf_change"
	Topic   string `json:"topic,omitempty"`
	QoS     byte   `json:"qos"`
	Retain  bool   `json:"retain"`
	Payload string `json:"payload"` // standard base64, or as --payload asks
	// PayloadEncoding is set when the payload is not in the encoding
	// asked for: with --payload text, a payload that is not UTF-8 is
	// printed in base64 (JSON would garble it), and this says "base64".
	PayloadEncoding string        `json:"payload_encoding,omitempty"`
	Client          string        `json:"client"`
	Time            string        `json:"time,omitempty"` // RFC 3339 with nanoseconds
	Origin          string        `json:"origin,omitempty"`
	Seq             uint64        `json:"seq,omitempty"`
	PacketID        uint16        `json:"packet_id,omitempty"`
	Will            bool          `json:"will,omitempty"`
	Republished     bool          `json:"republished,omitempty"`
	Props           *inspectProps `json:"properties,omitempty"`
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

func newInspectCmd() *cobra.Command {
	var dir string
	var from, limit uint64
	var all bool
	var payload string
	cmd := &cobra.Command{
		Use:   "inspect --data DIR",
		Short: "Print a stopped node's log, one JSON object per record",
		Long: `Print a stopped node's log, one JSON object per record: index, term, topic,
qos, retain, payload, client, time (and origin, seq, packet_id, will,
republished and MQTT 5 properties where set). The payload is standard base64
unless --payload asks for text (UTF-8; a payload that is not UTF-8 stays
base64, marked "payload_encoding": "base64") or hex.`,
		Example: `  tandem inspect --data /var/lib/tandem --from 100 --limit 10 --payload text`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" {
				return config.UsageError{Err: errors.New("inspect needs --data DIR")}
			}
			enc, ok := payloadEncoders[payload]
			if !ok {
				return config.UsageError{Err: fmt.Errorf("--payload %q: base64, text or hex", payload)}
			}
			return inspect(cmd.OutOrStdout(), dir, from, limit, all, enc)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&dir, "data", "", "data dir of a stopped node")
	fl.Uint64Var(&from, "from", 1, "first index")
	fl.Uint64Var(&limit, "limit", 0, "at most this many lines (0: all)")
	fl.BoolVar(&all, "all", false, "print membership (conf change) entries too")
	fl.StringVar(&payload, "payload", "base64", "how to print payloads: base64, text (UTF-8) or hex")
	fl.Bool("json", true, "JSON output (the only format)")
	return cmd
}

// payloadEncoder returns a payload as inspect prints it, and the name of
// the encoding when it is not the one asked for.
type payloadEncoder func([]byte) (string, string)

// payloadEncoders are the --payload choices.
var payloadEncoders = map[string]payloadEncoder{
	"base64": func(b []byte) (string, string) { return base64.StdEncoding.EncodeToString(b), "" },
	"hex":    func(b []byte) (string, string) { return hex.EncodeToString(b), "" },
	"text": func(b []byte) (string, string) {
		if utf8.Valid(b) {
			return string(b), ""
		}
		return base64.StdEncoding.EncodeToString(b), "base64"
	},
}

// inspect opens dir read-only, never changing it, and prints the log.
func inspect(w io.Writer, dir string, from, limit uint64, all bool, payload payloadEncoder) error {
	db, err := storage.Open(dir, &storage.Options{ReadOnly: true})
	if errors.Is(err, storage.ErrInUse) {
		return fmt.Errorf("%w: inspect reads a stopped gateway's log; stop this one first (systemctl stop tandem, or its tandem run), or ask the running one with tandem status", err)
	}
	if err != nil {
		return err
	}
	defer db.Close()
	enc := json.NewEncoder(w)
	var n uint64
	var werr error
	err = db.Scan(from, func(e pb.Entry) bool {
		var out InspectRecord
		switch {
		case e.Type == pb.EntryNormal && len(e.Data) > 0:
			rec, err := storage.DecodeRecord(e.Data)
			if err != nil {
				werr = fmt.Errorf("entry %d: %w", e.Index, err)
				return false
			}
			out = InspectRecord{
				Index: e.Index, Term: e.Term, Topic: rec.Topic, QoS: rec.QoS, Retain: rec.Retain,
				Client: rec.ClientID,
				Time:   time.Unix(0, rec.Time).UTC().Format(time.RFC3339Nano),
				Origin: replication.IDString(rec.Origin), Seq: rec.Seq, PacketID: rec.PacketID,
				Will: rec.Will, Republished: rec.Republished,
			}
			out.Payload, out.PayloadEncoding = payload(rec.Payload)
			out.Props = propsOf(&rec.Props)
			if all {
				out.Type = "record"
			}
		case all && e.Type != pb.EntryNormal:
			out = InspectRecord{Index: e.Index, Term: e.Term, Type: "conf_change"}
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
	return err
}
