package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/daemon"
	"github.com/tandem-edge/tandem/internal/procs"
	"github.com/tandem-edge/tandem/internal/version"
)

// Exit codes of the contract.
const (
	ExitOK      = 0
	ExitFailure = 1
	ExitUsage   = 2
)

// Main runs the tandem command line and returns the process exit code.
func Main(args []string, stdout, stderr io.Writer) int {
	root := newRoot(stdout, stderr)
	root.SetArgs(args)
	err := root.Execute()
	if err == nil {
		return ExitOK
	}
	var list config.ErrorList
	if errors.As(err, &list) {
		for _, e := range list { // one line each: a config's every error
			fmt.Fprintln(stderr, "tandem:", e)
		}
	} else {
		fmt.Fprintln(stderr, "tandem:", err)
	}
	var ue config.UsageError
	var ce *config.ConfigError
	if errors.As(err, &ue) || errors.As(err, &ce) || strings.HasPrefix(err.Error(), "unknown command") {
		return ExitUsage
	}
	return ExitFailure
}

func newRoot(stdout, stderr io.Writer) *cobra.Command {
	root := &cobra.Command{
		Use:           "tandem",
		Short:         "Durable, replicated MQTT for edge gateways",
		Long:          "tandem is an MQTT gateway that keeps every publish in a crash-safe log and replicates it across 2 or 3 gateways.",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return config.UsageError{Err: err} })
	root.AddCommand(newRunCmd(), newVersionCmd(), newCheckCmd(), newInspectCmd(), newBenchCmd(), newServiceCmd(), newPasswdCmd(), newUplinkCmd(),
		newStatusCmd(), newPeersCmd(), newClusterCmd(), newPairCmd(), newPromoteCmd(), newRepairCmd(), newManCmd())
	for _, c := range root.Commands() {
		if c.Args != nil {
			args := c.Args
			c.Args = func(cmd *cobra.Command, a []string) error {
				if err := args(cmd, a); err != nil {
					return config.UsageError{Err: err}
				}
				return nil
			}
		}
	}
	return root
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print version, commit, Go version and platform",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fmt.Fprintf(cmd.OutOrStdout(), "tandem %s (commit %s, %s, %s/%s)\n", version.Version, version.Commit, runtime.Version(), runtime.GOOS, runtime.GOARCH)
			return nil
		},
	}
}

func newCheckCmd() *cobra.Command {
	var path string
	cmd := &cobra.Command{
		Use:   "check --config FILE",
		Short: "Validate a config file",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if path == "" {
				return config.UsageError{Err: errors.New("check needs --config FILE")}
			}
			// What run checks, every error at once (daemon.CheckConfig).
			if err := daemon.CheckConfig(path); err != nil {
				return config.UsageError{Err: err}
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: ok\n", path)
			return nil
		},
	}
	cmd.Flags().StringVar(&path, "config", "", "config file to validate")
	return cmd
}

// runFlags are the flags of `tandem run`; set ones override the config.
type runFlags struct {
	config, data, mqtt, peer, http, name, pprof string
}

func newRunCmd() *cobra.Command {
	var f runFlags
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run the gateway in the foreground",
		Long:  "Run the gateway in the foreground. With no flags and no config: a standalone gateway, data in ./tandem-data, MQTT on 127.0.0.1:1883 (anonymous, loopback only), HTTP on 127.0.0.1:7880.",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.load(cmd)
			if err != nil {
				return config.UsageError{Err: err}
			}
			if f.pprof != "" {
				stop, err := admin.ServePprof(f.pprof)
				if err != nil {
					return fmt.Errorf("--pprof: %w", err)
				}
				defer stop()
			}
			return runDaemon(cfg, cmd.ErrOrStderr())
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.config, "config", "", "config file (YAML)")
	fl.StringVar(&f.data, "data", "", "data dir (node.data_dir)")
	fl.StringVar(&f.mqtt, "mqtt", "", "MQTT listen address (mqtt.listen)")
	fl.StringVar(&f.peer, "peer", "", "peer listen address (peer.listen)")
	fl.StringVar(&f.http, "http", "", "HTTP listen address (http.listen)")
	fl.StringVar(&f.name, "name", "", "node name (node.name)")
	fl.StringVar(&f.pprof, "pprof", "", "serve Go's pprof profiles on this address (e.g. 127.0.0.1:6060)")
	return cmd
}

func (f *runFlags) load(cmd *cobra.Command) (*config.Config, error) {
	cfg := config.DefaultConfig()
	var loadErr error
	if f.config != "" {
		if cfg, loadErr = config.LoadAll(f.config); cfg == nil {
			return nil, loadErr
		}
	}
	set := func(flag string, dst *string, v string) {
		if cmd.Flags().Changed(flag) {
			*dst = v
		}
	}
	set("data", &cfg.Node.DataDir, f.data)
	set("mqtt", &cfg.MQTT.Listen, f.mqtt)
	set("peer", &cfg.Peer.Listen, f.peer)
	set("http", &cfg.HTTP.Listen, f.http)
	set("name", &cfg.Node.Name, f.name)
	// The checks of `tandem check`, every error at once.
	if err := daemon.Check(cfg, loadErr); err != nil {
		return nil, err
	}
	return cfg, nil
}

// newLogger builds the daemon's slog handler: text or JSON, at the level set.
func newLogger(cfg config.LogConfig, w io.Writer) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(cfg.Level))
	opts := &slog.HandlerOptions{Level: lvl}
	if cfg.Format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// memoryHeadroom is what the process may hold beside limits.memory: the
// runtime, the binary's heap, raft's and the storage's buffers.
const memoryHeadroom = 32 << 20

// setMemoryLimit gives Go's collector a soft limit of limits.memory plus
// memoryHeadroom, unless GOMEMLIMIT says otherwise: near it the collector
// runs more often instead of letting garbage double the heap (GOGC's
// default), so the RSS stays near what the budget promises.
func setMemoryLimit(cfg *config.Config) {
	if os.Getenv("GOMEMLIMIT") != "" {
		return
	}
	debug.SetMemoryLimit(int64(cfg.Limits.Memory) + memoryHeadroom)
}

// runDaemon runs until SIGTERM/SIGINT (clean stop, nil) or a failure.
func runDaemon(cfg *config.Config, logw io.Writer) error {
	// Signals first: a reload or stop that arrives while the daemon starts
	// is handled once it has, not fatal (SIGHUP's default is to exit).
	sigc := make(chan os.Signal, 4)
	signal.Notify(sigc, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer signal.Stop(sigc)
	log := newLogger(cfg.Log, logw)
	setMemoryLimit(cfg)
	d, err := daemon.New(cfg, log)
	if err != nil {
		return config.UsageError{Err: err}
	}
	if err := d.Start(context.Background()); err != nil {
		return err
	}
	// After Start: what sizes itself by GOMAXPROCS at start (the broker's
	// bcrypt slots) sees the processors the host gives.
	stopProcs := procs.Start(log)
	defer stopProcs()
	for {
		select {
		case s := <-sigc:
			if s == syscall.SIGHUP {
				if err := d.Reload(); err != nil {
					log.Error("reload failed; keeping the previous users, ACLs and topic rules", "error", err)
				} else {
					log.Info("reloaded users, ACLs and topic rules")
				}
				continue
			}
			log.Info("stopping", "signal", s.String())
			return d.Stop()
		case <-d.Failed():
			err := d.Err()
			d.Stop()
			return err
		}
	}
}
