package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
)

// defaultHTTP is where the CLI finds the daemon when told nothing else:
// DefaultConfig's http.listen.
const defaultHTTP = "127.0.0.1:7880"

// newStatusCmd is `tandem status`.
func newStatusCmd() *cobra.Command {
	var httpAddr, configFile, tokenFile string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the running gateway's status",
		Long: "Show the running gateway's status: node, role, term and master, the other members with their lag,\n" +
			"the log's indexes, disk use and connected clients. It asks the daemon over its HTTP listener\n" +
			"(--http, or http.listen of --config, default " + defaultHTTP + ").",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			addr, token, err := daemonEndpoint(cmd, httpAddr, configFile, tokenFile)
			if err != nil {
				return err
			}
			body, err := getStatus(addr, token)
			if err != nil {
				return err
			}
			if asJSON {
				_, err = cmd.OutOrStdout().Write(body)
				return err
			}
			var s Status
			if err := json.Unmarshal(body, &s); err != nil {
				return fmt.Errorf("the daemon at %s answered with a status this version cannot read: %w", addr, err)
			}
			return writeStatus(cmd.OutOrStdout(), &s)
		},
	}
	cmd.Flags().StringVar(&httpAddr, "http", "", "the daemon's HTTP address (default "+defaultHTTP+")")
	cmd.Flags().StringVar(&configFile, "config", "", "take the HTTP address (http.listen) and token from this config file")
	cmd.Flags().StringVar(&tokenFile, "token-file", "", "bearer token file, for a daemon that requires one (default http.token_file of --config)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status JSON as the daemon serves it")
	return cmd
}

// daemonEndpoint resolves where the daemon listens: --http wins, then the
// config's http.listen (a wildcard host becomes loopback, which it also
// serves), then the default. The token comes from --token-file, else the
// config's http.token_file, when there is one.
func daemonEndpoint(cmd *cobra.Command, httpAddr, configFile, tokenFile string) (addr, token string, err error) {
	addr = defaultHTTP
	if configFile != "" {
		cfg, err := LoadConfig(configFile)
		if err != nil {
			return "", "", err
		}
		addr = statusDialAddr(cfg.HTTP.Listen)
		if tokenFile == "" {
			tokenFile = cfg.HTTP.TokenFile
		}
	}
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return "", "", usageError{fmt.Errorf("token file: %w", err)}
		}
		token = strings.TrimSpace(string(b))
	}
	if cmd.Flags().Changed("http") {
		addr = httpAddr
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return "", "", usageError{fmt.Errorf("--http %q: want host:port", addr)}
	}
	return addr, token, nil
}

// statusDialAddr turns a listen address into one to dial: ":7880" and
// "0.0.0.0:7880" listen on loopback too.
func statusDialAddr(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return listen
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port)
}

// getStatus fetches /v1/status and returns the body as served.
func getStatus(addr, token string) ([]byte, error) {
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+"/v1/status", nil)
	if err != nil {
		return nil, usageError{err}
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return nil, fmt.Errorf("no tandem daemon answers at %s (is it running? --http or --config say where it listens): %w", addr, unwrapURL(err))
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return nil, fmt.Errorf("reading the status from %s: %w", addr, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("the daemon at %s answered %s: %s", addr, resp.Status, strings.TrimSpace(string(body)))
	}
	return body, nil
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

// writeStatus prints s for a person: this node first, then the members.
func writeStatus(w io.Writer, s *Status) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	leader := "none"
	if s.Leader != nil {
		leader = nameOr(s.Leader.Name, s.Leader.ID) + " (" + short(s.Leader.ID) + ")"
	}
	fmt.Fprintf(tw, "node\t%s (%s), tandem %s\n", s.Node.Name, short(s.Node.ID), s.Node.Version)
	fmt.Fprintf(tw, "role\t%s, term %d\n", s.Role, s.Term)
	fmt.Fprintf(tw, "master\t%s\n", leader)
	fmt.Fprintf(tw, "log\tfirst %d, last %d, committed %d, applied %d\n", s.Log.FirstIndex, s.Log.LastIndex, s.Log.CommitIndex, s.Log.AppliedIndex)
	disk := fmt.Sprintf("%s used, %s free", bytesIEC(uint64(max(s.Disk.UsedBytes, 0))), bytesIEC(s.Disk.FreeBytes))
	if s.Disk.BudgetBytes > 0 {
		disk += ", budget " + bytesIEC(s.Disk.BudgetBytes)
	}
	fmt.Fprintf(tw, "disk\t%s\n", disk)
	fmt.Fprintf(tw, "clients\t%d connected, %d messages in flight\n", s.MQTT.Clients, s.MQTT.Inflight)
	pairing := "closed"
	if s.Pairing.Open {
		pairing = "open"
		if s.Pairing.Expires != nil {
			pairing += " until " + s.Pairing.Expires.Local().Format(time.TimeOnly)
		}
	}
	fmt.Fprintf(tw, "pairing\t%s\n", pairing)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	if len(s.Members) == 0 {
		_, err := fmt.Fprintln(w, "members: none (a lone gateway)")
		return err
	}
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MEMBER\tID\tROLE\tVOTER\tADDRESS\tREACHABLE\tMATCH\tLAG RECORDS\tLAG SECONDS")
	for _, m := range s.Members {
		reach := "yes"
		if !m.Reachable {
			reach = "no"
			if s.Role != "master" {
				reach = "?" // only the master hears from every member
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%.2f\n", nameOr(m.Name, m.ID), short(m.ID), m.Role, yesNo(m.Voter),
			orDash(m.Addr), reach, m.MatchIndex, m.LagRecords, m.LagSeconds)
	}
	return tw.Flush()
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
