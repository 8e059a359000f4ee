package daemon

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/replication"
)

// The cluster API: what `tandem cluster ...` asks of the running daemon.
// Answers are JSON; an error is {"error": "..."} with a status saying whose
// fault it is (400: the request, 409: refused as things stand, 503: no
// master now).

type inviteRequest struct {
	TTL string `json:"ttl,omitempty"`
}

type inviteResponse struct {
	Token   string `json:"token"`
	Expires string `json:"expires"`
}

type joinAPIRequest struct {
	Token string `json:"token"`
	Mode  string `json:"mode,omitempty"` // "", "requeue" or "discard"
}

type joinAPIResponse struct {
	Cluster string   `json:"cluster"`
	Master  string   `json:"master"`
	Members []string `json:"members"`
}

type removeRequest struct {
	Node  string `json:"node"`
	Force bool   `json:"force,omitempty"`
}

type removeResponse struct {
	Removed string `json:"removed"`
}

type apiError struct {
	Error string `json:"error"`
}

// registerClusterAPI adds the cluster commands' endpoints.
func (d *Daemon) registerClusterAPI(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/cluster/invite", d.mutating(d.handleInvite))
	mux.HandleFunc("POST /v1/cluster/join", d.mutating(d.handleJoin))
	mux.HandleFunc("POST /v1/cluster/remove", d.mutating(d.handleRemove))
	mux.HandleFunc("POST /v1/cluster/promote", d.mutating(d.handlePromote))
	d.registerPairAPI(mux)
}

// mutating guards an endpoint that changes the cluster: callers on
// loopback are trusted (the CLI on the gateway itself); any other caller
// must present http.token_file's token, and without one configured such
// calls are refused.
func (d *Daemon) mutating(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if tf := d.cfg.HTTP.TokenFile; tf != "" {
			want, err := readToken(tf)
			got := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
			if err != nil || subtle.ConstantTimeCompare([]byte(got), []byte(want)) != 1 {
				writeAPIError(w, http.StatusUnauthorized, errors.New("a valid bearer token (http.token_file) is required"))
				return
			}
		} else if !fromLoopback(r) {
			writeAPIError(w, http.StatusForbidden, errors.New("cluster commands from another host need http.token_file set on this gateway"))
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
		h(w, r)
	}
}

// readToken reads a token file: its first line, trimmed.
func readToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	tok, _, _ := strings.Cut(string(b), "\n")
	tok = strings.TrimSpace(tok)
	if tok == "" {
		return "", fmt.Errorf("%s: empty token", path)
	}
	return tok, nil
}

func fromLoopback(r *http.Request) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	ip := net.ParseIP(host)
	return err == nil && ip != nil && ip.IsLoopback()
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeAPIError(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, apiError{Error: err.Error()})
}

// statusOf maps an error to the status of its answer.
func statusOf(err error) int {
	var ue usageError
	switch {
	case errors.As(err, &ue):
		return http.StatusBadRequest
	case errors.Is(err, errNoMaster):
		return http.StatusServiceUnavailable
	}
	return http.StatusConflict
}

func decodeBody(r *http.Request, v any) error {
	if err := json.NewDecoder(r.Body).Decode(v); err != nil && !errors.Is(err, io.EOF) {
		return usageError{fmt.Errorf("request body: %w", err)}
	}
	return nil
}

func (d *Daemon) handleInvite(w http.ResponseWriter, r *http.Request) {
	var req inviteRequest
	if err := decodeBody(r, &req); err != nil {
		writeAPIError(w, statusOf(err), err)
		return
	}
	var ttl time.Duration
	if req.TTL != "" {
		var err error
		if ttl, err = time.ParseDuration(req.TTL); err != nil || ttl <= 0 || ttl > 7*24*time.Hour {
			writeAPIError(w, http.StatusBadRequest, fmt.Errorf("ttl %q: a duration up to 168h", req.TTL))
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	rep, err := d.cl.admin(ctx, adminRequest{Op: "invite", TTL: ttl})
	if err != nil {
		writeAPIError(w, statusOf(err), err)
		return
	}
	tok, _, err := parseToken(rep.Token, time.Now())
	if err != nil {
		writeAPIError(w, http.StatusInternalServerError, err)
		return
	}
	writeJSON(w, http.StatusOK, inviteResponse{Token: rep.Token, Expires: time.Unix(tok.Expires, 0).UTC().Format(time.RFC3339)})
}

func (d *Daemon) handleJoin(w http.ResponseWriter, r *http.Request) {
	var req joinAPIRequest
	if err := decodeBody(r, &req); err != nil {
		writeAPIError(w, statusOf(err), err)
		return
	}
	mode, err := parseJoinMode(req.Mode)
	if err != nil {
		writeAPIError(w, http.StatusBadRequest, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	rep, err := d.cl.join(ctx, req.Token, mode)
	if err != nil {
		writeAPIError(w, statusOf(err), err)
		return
	}
	out := joinAPIResponse{Cluster: rep.Cluster, Master: rep.Master}
	for _, m := range rep.Members {
		out.Members = append(out.Members, m.Name)
	}
	writeJSON(w, http.StatusOK, out)
}

// parseJoinMode reads the mode of a join request.
func parseJoinMode(s string) (joinMode, error) {
	switch m := joinMode(s); m {
	case joinFresh, joinRequeue, joinDiscard:
		return m, nil
	}
	return "", fmt.Errorf("mode %q: requeue or discard", s)
}

func (d *Daemon) handleRemove(w http.ResponseWriter, r *http.Request) {
	var req removeRequest
	if err := decodeBody(r, &req); err != nil {
		writeAPIError(w, statusOf(err), err)
		return
	}
	if req.Node == "" {
		writeAPIError(w, http.StatusBadRequest, errors.New("which node? give its name or id"))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	rep, err := d.cl.admin(ctx, adminRequest{Op: "remove", Node: req.Node, Force: req.Force})
	if err != nil {
		if errors.Is(err, replication.ErrLastVoter) {
			err = errors.New("cannot remove the last voter of the cluster")
		}
		writeAPIError(w, statusOf(err), err)
		return
	}
	writeJSON(w, http.StatusOK, removeResponse{Removed: rep.Removed})
}

// apiFlags are how a CLI command finds the running daemon's HTTP API.
type apiFlags struct {
	http, config, tokenFile string
}

func (f *apiFlags) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.http, "http", "", "the daemon's HTTP address (default 127.0.0.1:7880, or http.listen of --config)")
	cmd.Flags().StringVar(&f.config, "config", "", "read the HTTP address and token file from this config file")
	cmd.Flags().StringVar(&f.tokenFile, "token-file", "", "bearer token file for a daemon on another host (default http.token_file of --config)")
}

// call POSTs req to the daemon's path and decodes the answer into out.
func (f *apiFlags) call(path string, req, out any) error {
	addr, tokFile := f.http, f.tokenFile
	if f.config != "" {
		cfg, err := LoadConfig(f.config)
		if err != nil {
			return err
		}
		if addr == "" {
			addr = cfg.HTTP.Listen
		}
		if tokFile == "" {
			tokFile = cfg.HTTP.TokenFile
		}
	}
	if addr == "" {
		addr = DefaultConfig().HTTP.Listen
	}
	addr = dialable(addr)
	body, _ := json.Marshal(req)
	hr, err := http.NewRequest(http.MethodPost, "http://"+addr+path, bytes.NewReader(body))
	if err != nil {
		return usageError{err}
	}
	hr.Header.Set("Content-Type", "application/json")
	if tokFile != "" {
		tok, err := readToken(tokFile)
		if err != nil {
			return usageError{err}
		}
		hr.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := (&http.Client{Timeout: 90 * time.Second}).Do(hr)
	if err != nil {
		return fmt.Errorf("no tandem daemon answers at %s (is it running? --http or --config): %w", addr, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		var ae apiError
		if json.Unmarshal(b, &ae) != nil || ae.Error == "" {
			ae.Error = strings.TrimSpace(string(b))
		}
		if resp.StatusCode == http.StatusBadRequest {
			return usageError{errors.New(ae.Error)}
		}
		return errors.New(ae.Error)
	}
	return json.Unmarshal(b, out)
}

// dialable turns a listen address into one to dial: a listener on every
// interface is reached on loopback.
func dialable(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return net.JoinHostPort("127.0.0.1", port)
	}
	return addr
}

// newClusterCmd is `tandem cluster invite|join|remove`.
func newClusterCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "Grow or shrink the cluster of gateways (invite, join, remove)",
	}
	var af apiFlags
	var ttl time.Duration
	invite := &cobra.Command{
		Use:   "invite",
		Short: "Print a one-time join token for a new gateway (run on any member; the master issues it)",
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var out inviteResponse
			req := inviteRequest{}
			if ttl != 0 {
				req.TTL = ttl.String()
			}
			if err := af.call("/v1/cluster/invite", req, &out); err != nil {
				return err
			}
			fmt.Fprintln(c.OutOrStdout(), out.Token)
			fmt.Fprintf(c.ErrOrStderr(), "valid until %s, for one gateway: run `tandem cluster join TOKEN` on it\n", out.Expires)
			return nil
		},
	}
	invite.Flags().DurationVar(&ttl, "ttl", defaultInviteTTL, "how long the token stays valid")
	af.add(invite)

	var jf apiFlags
	var requeue, discard bool
	join := &cobra.Command{
		Use:   "join TOKEN",
		Short: "Make this gateway a member of the cluster that issued TOKEN",
		Long: "Make this gateway a member of the cluster that issued TOKEN. A gateway whose log holds records must say what becomes of them: " +
			"--requeue publishes them into the cluster, --discard drops them.",
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			if requeue && discard {
				return usageError{errors.New("--requeue and --discard exclude each other")}
			}
			req := joinAPIRequest{Token: args[0]}
			if requeue {
				req.Mode = string(joinRequeue)
			} else if discard {
				req.Mode = string(joinDiscard)
			}
			if _, _, err := parseToken(args[0], time.Now()); err != nil {
				return usageError{err}
			}
			var out joinAPIResponse
			if err := jf.call("/v1/cluster/join", req, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "joined cluster %s (master %s; members %s)\n", out.Cluster, out.Master, strings.Join(out.Members, ", "))
			return nil
		},
	}
	join.Flags().BoolVar(&requeue, "requeue", false, "publish this gateway's records into the cluster")
	join.Flags().BoolVar(&discard, "discard", false, "drop this gateway's records")
	jf.add(join)

	var rf apiFlags
	var force bool
	remove := &cobra.Command{
		Use:   "remove NODE",
		Short: "Take a gateway (name or id) out of the cluster",
		Args:  cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			var out removeResponse
			if err := rf.call("/v1/cluster/remove", removeRequest{Node: args[0], Force: force}, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "removed %s\n", out.Removed)
			return nil
		},
	}
	remove.Flags().BoolVar(&force, "force", false, "remove it even if sync topics can then no longer be acked")
	rf.add(remove)

	cmd.AddCommand(invite, join, remove)
	for _, sub := range cmd.Commands() {
		args := sub.Args
		sub.Args = func(c *cobra.Command, a []string) error {
			if err := args(c, a); err != nil {
				return usageError{err}
			}
			return nil
		}
	}
	return cmd
}
