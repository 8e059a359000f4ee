package admin

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/tandem-edge/tandem/config"
)

// The cluster API's requests and answers: what `tandem cluster ...` asks of
// the running daemon. Answers are JSON; an error is {"error": "..."} with a
// status saying whose fault it is (400: the request, 409: refused as things
// stand, 503: no master now).

// InviteRequest is the body of POST /v1/cluster/invite.
type InviteRequest struct {
	TTL string `json:"ttl,omitempty"`
}

// InviteResponse answers an invite with the join token and its expiry.
type InviteResponse struct {
	Token   string `json:"token"`
	Expires string `json:"expires"`
}

// JoinRequest is the body of POST /v1/cluster/join.
type JoinRequest struct {
	Token string `json:"token"`
	Mode  string `json:"mode,omitempty"` // "", "requeue" or "discard"
}

// JoinResponse answers a join with the cluster joined.
type JoinResponse struct {
	Cluster string   `json:"cluster"`
	Master  string   `json:"master"`
	Members []string `json:"members"`
	// Voter: this gateway and the others vote (three members, all
	// promoted); false for a 2-gateway slave, or while one catches up.
	Voter bool `json:"voter"`
	// CatchUpTo is the master's commit index when it took this gateway
	// in: the history the gateway replays, or takes in as a snapshot.
	CatchUpTo uint64 `json:"catch_up_to"`
}

// RemoveRequest is the body of POST /v1/cluster/remove.
type RemoveRequest struct {
	Node  string `json:"node"`
	Force bool   `json:"force,omitempty"`
}

// RemoveResponse names the member removed.
type RemoveResponse struct {
	Removed string `json:"removed"`
}

// LogRequest is the body of POST /v1/log, `tandem inspect` of a running
// gateway: from index From, at most Limit lines (0: all), conf changes too
// with All, payloads as Payload says (base64, text, hex). The answer is
// the lines `tandem inspect` prints, one JSON object each. A POST, behind
// the API token, because it hands out what devices published.
type LogRequest struct {
	From    uint64 `json:"from"`
	Limit   uint64 `json:"limit"`
	All     bool   `json:"all"`
	Payload string `json:"payload"`
}

// ErrorResponse is every error answer of the API: {"error": "..."}.
type ErrorResponse struct {
	Error string `json:"error"`
}

// PairOpenRequest is the body of POST /v1/pair/open.
type PairOpenRequest struct {
	TTL string `json:"ttl,omitempty"`
}

// PairOpenResponse answers with the pairing code and its expiry.
type PairOpenResponse struct {
	Code    string `json:"code"`
	Expires string `json:"expires"`
}

// PairJoinRequest is the body of POST /v1/pair/join.
type PairJoinRequest struct {
	Code    string `json:"code"`
	Mode    string `json:"mode,omitempty"`    // "", "requeue" or "discard"
	Timeout string `json:"timeout,omitempty"` // how long to look for the open gateway
	Addr    string `json:"addr,omitempty"`    // knock here instead of browsing
}

// MaxPairBrowse bounds pair join's --timeout, so that browsing plus the
// join itself fit in the CLI's wait for the daemon's answer.
const MaxPairBrowse = 30 * time.Second

// DefaultPairBrowse is how long pair join looks for the open gateway.
const DefaultPairBrowse = 10 * time.Second

// PromoteRequest is the body of POST /v1/cluster/promote.
type PromoteRequest struct {
	Force bool `json:"force,omitempty"`
}

// PromoteResponse names the master this gateway replaced.
type PromoteResponse struct {
	Deposed    string `json:"deposed"`
	Generation uint64 `json:"generation"`
}

// WriteJSON answers with code and v as JSON.
func WriteJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// WriteError answers with code and {"error": err}.
func WriteError(w http.ResponseWriter, code int, err error) {
	WriteJSON(w, code, ErrorResponse{Error: err.Error()})
}

// DecodeBody reads a request's JSON object into v. It is strict, so that
// nothing but a client that means this API gets through: an empty body,
// an unknown field or anything after the object is refused (an HTML form
// posted as text/plain carries an extra "=" field).
func DecodeBody(r *http.Request, v any) error {
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return config.UsageError{Err: errors.New("request body: empty (send a JSON object, {} at least)")}
		}
		return config.UsageError{Err: fmt.Errorf("request body: %w", err)}
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return config.UsageError{Err: errors.New("request body: more than one JSON value")}
	}
	return nil
}
