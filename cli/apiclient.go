package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
)

// apiFlags are how a CLI command finds the running daemon's HTTP API and
// its token. With none of them given the CLI looks where a daemon started
// without flags (./tandem-data) and the packaged service
// (DefaultServiceConfig's data dir) keep their token, so `tandem cluster
// invite` works on a gateway as it is.
type apiFlags struct {
	http, config, data, tokenFile string
}

func (f *apiFlags) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.http, "http", "", "the daemon's HTTP address (default "+defaultHTTP+", or http.listen of --config)")
	cmd.Flags().StringVar(&f.config, "config", "", "read the HTTP address and the API token's place from this config file")
	cmd.Flags().StringVar(&f.data, "data", "", "the daemon's data dir, which holds its API token (default node.data_dir of --config)")
	cmd.Flags().StringVar(&f.tokenFile, "token-file", "", "API token file (default http.token_file of --config, else the data dir's http-token)")
}

// endpoint returns the address to dial and the token files to try, in
// order.
func (f *apiFlags) endpoint() (addr string, tokenFiles []string, err error) {
	cfg := config.DefaultConfig()
	if f.config != "" {
		if cfg, err = config.Load(f.config); err != nil {
			return "", nil, err
		}
	}
	addr = f.http
	if addr == "" {
		addr = dialable(cfg.HTTP.Listen)
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return "", nil, config.UsageError{Err: fmt.Errorf("--http %q: want host:port", addr)}
	}
	if f.data != "" {
		cfg.Node.DataDir = f.data
	}
	switch {
	case f.tokenFile != "":
		return addr, []string{f.tokenFile}, nil
	case f.config != "" || f.data != "":
		return addr, []string{admin.TokenFile(cfg)}, nil
	}
	tokenFiles = []string{admin.TokenFile(cfg)}
	if pc, err := config.Load(DefaultServiceConfig); err == nil {
		tokenFiles = append(tokenFiles, admin.TokenFile(pc))
	}
	return addr, tokenFiles, nil
}

// do sends one request to the daemon and returns the status and body. The
// token files are tried in turn while the daemon answers 401.
func (f *apiFlags) do(method, path string, body []byte, timeout time.Duration) (string, int, []byte, error) {
	return f.doTo(method, path, body, timeout, nil)
}

// doTo is do, with a 200 answer's body copied to sink as it comes instead
// of returned (when sink is not nil): answers larger than do keeps.
func (f *apiFlags) doTo(method, path string, body []byte, timeout time.Duration, sink io.Writer) (string, int, []byte, error) {
	addr, files, err := f.endpoint()
	if err != nil {
		return addr, 0, nil, err
	}
	var tokens []string
	var unreadable []string
	for _, tf := range files {
		tok, err := admin.ReadToken(tf)
		switch {
		case err == nil:
			tokens = append(tokens, tok)
		case !errors.Is(err, fs.ErrNotExist) || f.tokenFile != "":
			unreadable = append(unreadable, err.Error())
		}
	}
	if len(tokens) == 0 {
		tokens = []string{""} // the read-only endpoints need none
	}
	client := &http.Client{Timeout: timeout}
	var code int
	var b []byte
	for _, tok := range tokens {
		var rd io.Reader
		if body != nil {
			rd = bytes.NewReader(body)
		}
		hr, err := http.NewRequest(method, "http://"+addr+path, rd)
		if err != nil {
			return addr, 0, nil, config.UsageError{Err: err}
		}
		if body != nil {
			hr.Header.Set("Content-Type", "application/json")
		}
		if tok != "" {
			hr.Header.Set("Authorization", "Bearer "+tok)
		}
		resp, err := client.Do(hr)
		if err != nil {
			return addr, 0, nil, fmt.Errorf("no tandem daemon answers at %s (is it running? --http or --config say where it listens): %w", addr, unwrapURL(err))
		}
		if sink != nil && resp.StatusCode == http.StatusOK {
			_, err := io.Copy(sink, resp.Body)
			resp.Body.Close()
			return addr, resp.StatusCode, nil, err
		}
		b, err = io.ReadAll(io.LimitReader(resp.Body, 4<<20))
		resp.Body.Close()
		if err != nil {
			return addr, 0, nil, fmt.Errorf("reading the answer of %s: %w", addr, err)
		}
		if code = resp.StatusCode; code != http.StatusUnauthorized {
			return addr, code, b, nil
		}
	}
	hint := "run it as a user who can read the daemon's data dir (sudo), or give --config, --data or --token-file"
	if len(unreadable) > 0 {
		hint = strings.Join(unreadable, "; ") + ": " + hint
	}
	return addr, code, b, config.UsageError{Err: fmt.Errorf("the daemon at %s wants its API token: %s", addr, hint)}
}

// call POSTs req to the daemon's path and decodes the answer into out.
func (f *apiFlags) call(path string, req, out any) error {
	body, _ := json.Marshal(req)
	_, code, b, err := f.do(http.MethodPost, path, body, 90*time.Second)
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		var ae admin.ErrorResponse
		if json.Unmarshal(b, &ae) != nil || ae.Error == "" {
			ae.Error = strings.TrimSpace(string(b))
		}
		if code == http.StatusBadRequest {
			return config.UsageError{Err: errors.New(ae.Error)}
		}
		return errors.New(ae.Error)
	}
	return json.Unmarshal(b, out)
}

// getStatus fetches /v1/status and returns the body as served.
func (f *apiFlags) getStatus() (string, []byte, error) {
	addr, code, body, err := f.do(http.MethodGet, "/v1/status", nil, 5*time.Second)
	if err != nil {
		return addr, nil, err
	}
	if code != http.StatusOK {
		return addr, nil, fmt.Errorf("the daemon at %s answered %d %s: %s", addr, code, http.StatusText(code), strings.TrimSpace(string(body)))
	}
	return addr, body, nil
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

// unwrapURL drops net/http's "Get \"http://…\":" prefix; the message says
// the address already.
func unwrapURL(err error) error {
	var ue interface{ Unwrap() error }
	if errors.As(err, &ue) && ue.Unwrap() != nil {
		return ue.Unwrap()
	}
	return err
}
