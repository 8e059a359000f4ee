package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	inspectpkg "github.com/tandem-edge/tandem/internal/inspect"
	"github.com/tandem-edge/tandem/storage"
)

// InspectRecord is one line of `tandem inspect`.
type InspectRecord = inspectpkg.Record

func newInspectCmd() *cobra.Command {
	var af apiFlags
	var dir string
	var from, limit uint64
	var all bool
	var payload string
	cmd := &cobra.Command{
		Use:   "inspect --data DIR",
		Short: "Print a node's log, one JSON object per record",
		Long: `Print a node's log, one JSON object per record: index, term, topic,
qos, retain, payload, client, time (and origin, seq, packet_id, will,
republished and MQTT 5 properties where set). The payload is standard base64
unless --payload asks for text (UTF-8; a payload that is not UTF-8 stays
base64, marked "payload_encoding": "base64") or hex.

A stopped node's data dir is read directly, read-only. When a running
gateway holds the data dir, its log is asked of it over its HTTP API
(POST /v1/log, with the API token from the data dir; --http or --config
say where it listens).`,
		Example: `  tandem inspect --data /var/lib/tandem --from 100 --limit 10 --payload text`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" {
				return config.UsageError{Err: errors.New("inspect needs --data DIR")}
			}
			if _, ok := inspectpkg.Encoders[payload]; !ok {
				return config.UsageError{Err: fmt.Errorf("--payload %q: base64, text or hex", payload)}
			}
			q := inspectpkg.Query{From: from, Limit: limit, All: all, Payload: payload}
			err := inspectpkg.Dir(cmd.OutOrStdout(), dir, q)
			if errors.Is(err, storage.ErrInUse) {
				// The gateway runs: ask it, over its HTTP API.
				return af.streamLog(cmd.OutOrStdout(), dir, q)
			}
			return err
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&dir, "data", "", "the node's data dir (a running gateway's is read through its API)")
	fl.Uint64Var(&from, "from", 1, "first index")
	fl.Uint64Var(&limit, "limit", 0, "at most this many lines (0: all)")
	fl.BoolVar(&all, "all", false, "print membership (conf change) entries too")
	fl.StringVar(&payload, "payload", "base64", "how to print payloads: base64, text (UTF-8) or hex")
	fl.Bool("json", true, "JSON output (the only format)")
	fl.StringVar(&af.http, "http", "", "a running daemon's HTTP address (default "+defaultHTTP+", or http.listen of --config)")
	fl.StringVar(&af.config, "config", "", "read a running daemon's HTTP address and API token's place from this config file")
	fl.StringVar(&af.tokenFile, "token-file", "", "API token file (default: the data dir's http-token)")
	return cmd
}

// streamLog asks the running gateway whose data dir is dir for q's part
// of its log, and copies the lines to w as they come.
func (f *apiFlags) streamLog(w io.Writer, dir string, q inspectpkg.Query) error {
	f.data = dir
	body, _ := json.Marshal(admin.LogRequest(q))
	lw := &logLines{w: w}
	addr, code, b, err := f.doTo(http.MethodPost, "/v1/log", body, 10*time.Minute, lw)
	if err == nil {
		err = lw.end()
	}
	var se streamError
	if errors.As(err, &se) {
		return fmt.Errorf("%s (asked the running gateway holding %s)", se, dir)
	}
	if err != nil {
		return fmt.Errorf("%s is in use by a running gateway, and asking it failed: %w", dir, err)
	}
	if code != http.StatusOK {
		var ae admin.ErrorResponse
		if json.Unmarshal(b, &ae) != nil || ae.Error == "" {
			ae.Error = strings.TrimSpace(string(b))
		}
		return fmt.Errorf("%s is in use by a running gateway; its API at %s answered %d: %s", dir, addr, code, ae.Error)
	}
	return nil
}

// streamError is the error a running gateway wrote into its /v1/log
// stream, its status line being gone by then.
type streamError string

func (e streamError) Error() string { return string(e) }

// logLines copies a /v1/log stream line by line, keeping back the error
// line the gateway ends it with when reading failed (admin.ErrorResponse):
// the CLI prints that on stderr and exits non-zero, never 0 with it among
// the records.
type logLines struct {
	w       io.Writer
	partial []byte
	err     error
}

func (l *logLines) Write(p []byte) (int, error) {
	l.partial = append(l.partial, p...)
	for {
		i := bytes.IndexByte(l.partial, '\n')
		if i < 0 {
			return len(p), nil
		}
		if err := l.line(l.partial[:i+1]); err != nil {
			return 0, err
		}
		l.partial = l.partial[i+1:]
	}
}

// line passes one line on, or keeps it as the stream's error.
func (l *logLines) line(b []byte) error {
	var ae admin.ErrorResponse
	if bytes.HasPrefix(b, []byte(`{"error":`)) && json.Unmarshal(b, &ae) == nil && ae.Error != "" {
		l.err = streamError(ae.Error)
		return nil
	}
	_, err := l.w.Write(b)
	return err
}

// end passes on a last line without its newline, and returns the
// stream's error.
func (l *logLines) end() error {
	if len(l.partial) > 0 {
		if err := l.line(l.partial); err != nil {
			return err
		}
		l.partial = nil
	}
	return l.err
}
