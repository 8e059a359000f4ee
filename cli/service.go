package cli

// `tandem service install|uninstall|start|stop|restart|status`: tandem as a
// systemd service through github.com/kardianos/service, with the unit the
// .deb ships (packaging/tandem.service), never the one kardianos generates
// (a 120 s restart delay, /etc/sysconfig, no hardening).

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"

	"github.com/kardianos/service"
	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/packaging"
)

const (
	serviceName = "tandem"
	// serviceUser runs the unit (User= in packaging/tandem.service).
	serviceUser = "tandem"
	// serviceStateDir is the unit's StateDirectory and WorkingDirectory:
	// under ProtectSystem=strict the only place the service can write.
	serviceStateDir = "/var/lib/tandem"
	// DefaultServiceConfig is the configuration the service runs with
	// unless `tandem service install --config` names another.
	DefaultServiceConfig = "/etc/tandem/tandem.yaml"
	// systemdPlatform is what kardianos' Platform() says where systemd is
	// the running init. Its last resort, "unix-systemv", detects "yes"
	// everywhere, so anything else is refused rather than trusted.
	systemdPlatform = "linux-systemd"
	// localUnitPath is where kardianos writes a system unit.
	localUnitPath = "/etc/systemd/system/" + serviceName + ".service"
)

// packagedUnitPaths are where the .deb puts its unit (usrmerge makes them
// one file on Debian 12; both are checked for other layouts).
var packagedUnitPaths = []string{
	"/lib/systemd/system/" + serviceName + ".service",
	"/usr/lib/systemd/system/" + serviceName + ".service",
}

// serviceExecutable is the binary the installed unit runs; a variable so
// tests can point it at a binary outside their temporary directory.
var serviceExecutable = func() (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	return filepath.EvalSymlinks(exe)
}

// serviceProgram is kardianos' Interface. tandem never runs through
// kardianos' Run (the unit's ExecStart is `tandem run`), so Start and Stop
// have nothing to do: kardianos is used to install and control the unit.
type serviceProgram struct{}

func (serviceProgram) Start(service.Service) error { return nil }
func (serviceProgram) Stop(service.Service) error  { return nil }

func newServiceCmd() *cobra.Command {
	var configPath string
	cmd := &cobra.Command{
		Use:   "service install|uninstall|start|stop|restart|status",
		Short: "Install and control tandem as a systemd service",
		Long: `Install and control tandem as a systemd service (tandem.service).

install writes the unit the .deb ships (hardened, User=tandem, state in
/var/lib/tandem, logs in the journal) with ExecStart running this binary,
creates the system user tandem if missing, writes the default configuration
to /etc/tandem/tandem.yaml if it is missing, and enables the unit; start it
with "tandem service start". uninstall stops and removes the unit and keeps
the configuration, the data and the user. status exits 0 only while the
service runs. Where systemd is not the running init nothing is done and the
command exits 1. When the tandem package is installed, use systemctl.`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				return config.UsageError{Err: fmt.Errorf("unknown service action %q (install, uninstall, start, stop, restart, status)", args[0])}
			}
			return config.UsageError{Err: errors.New("service needs an action: install, uninstall, start, stop, restart or status")}
		},
		RunE: func(*cobra.Command, []string) error { return nil },
	}
	cmd.PersistentFlags().StringVar(&configPath, "config", DefaultServiceConfig, "configuration the service runs with (install)")
	actions := []struct{ name, short string }{
		{"install", "Install, enable and configure tandem.service (root)"},
		{"uninstall", "Stop and remove tandem.service; keep configuration, data and user (root)"},
		{"start", "Start tandem.service (root)"},
		{"stop", "Stop tandem.service (root)"},
		{"restart", "Restart tandem.service (root)"},
		{"status", "Print whether tandem.service runs; exit 0 only if it does"},
	}
	for _, a := range actions {
		action := a.name
		cmd.AddCommand(&cobra.Command{
			Use:   action,
			Short: a.short,
			Args: func(c *cobra.Command, args []string) error {
				if err := cobra.NoArgs(c, args); err != nil {
					return config.UsageError{Err: err}
				}
				return nil
			},
			RunE: func(c *cobra.Command, _ []string) error {
				return runService(c.OutOrStdout(), action, configPath, c.Flags().Changed("config"))
			},
		})
	}
	return cmd
}

// errNoSystemd is returned, before anything is touched, where systemd is
// not the running init.
var errNoSystemd = errors.New("systemd is not the running init system")

// runService checks everything an action needs before it changes anything,
// so a refusal never leaves a half-installed service behind.
func runService(out io.Writer, action, configPath string, configGiven bool) error {
	if p := service.Platform(); p != systemdPlatform {
		return fmt.Errorf("service %s: %w on this host (found %q): tandem installs only as a systemd unit; "+
			"start `tandem run --config %s` from this host's init system instead", action, errNoSystemd, p, configPath)
	}
	if action != "status" && os.Geteuid() != 0 {
		return fmt.Errorf("service %s: needs root (try sudo)", action)
	}
	if configGiven && action != "install" {
		return config.UsageError{Err: fmt.Errorf("service %s: --config only applies to install", action)}
	}
	switch action {
	case "install":
		return installService(out, configPath)
	case "uninstall":
		return uninstallService(out)
	}
	s, err := newKardianosService(serviceArgs(DefaultServiceConfig), "")
	if err != nil {
		return err
	}
	switch action {
	case "start":
		err = s.Start()
	case "stop":
		err = s.Stop()
	case "restart":
		err = s.Restart()
	case "status":
		return printServiceStatus(out, s)
	default:
		return config.UsageError{Err: fmt.Errorf("unknown service action %q", action)}
	}
	if err != nil {
		return fmt.Errorf("service %s: %w", action, err)
	}
	fmt.Fprintf(out, "%s.service: %s done\n", serviceName, action)
	return nil
}

func printServiceStatus(out io.Writer, s service.Service) error {
	st, err := s.Status()
	switch {
	case errors.Is(err, service.ErrNotInstalled):
		return fmt.Errorf("service status: %s.service is not installed", serviceName)
	case err != nil:
		return fmt.Errorf("service status: %w (journalctl -u %s tells why)", err, serviceName)
	case st == service.StatusRunning:
		fmt.Fprintf(out, "%s.service: running\n", serviceName)
		return nil
	case st == service.StatusStopped:
		fmt.Fprintf(out, "%s.service: stopped\n", serviceName)
		return errors.New("service status: not running")
	}
	return errors.New("service status: unknown")
}

func serviceArgs(configPath string) []string { return []string{"run", "--config", configPath} }

// newKardianosService describes tandem.service to kardianos; script is the
// unit template install writes ("" for the other actions, which only call
// systemctl).
func newKardianosService(args []string, exe string) (service.Service, error) {
	opts := service.KeyValue{}
	cfg := &service.Config{
		Name:        serviceName,
		DisplayName: "tandem",
		Description: "tandem durable, replicated MQTT gateway",
		Arguments:   args,
		Executable:  exe,
		UserName:    serviceUser,
		Option:      opts,
	}
	if exe != "" {
		opts["SystemdScript"] = unitTemplate()
	}
	return service.New(serviceProgram{}, cfg)
}

// unitTemplate is packaging/tandem.service in kardianos' template syntax:
// only the ExecStart line changes, to run the binary install is run from
// (kardianos fills in Path) with the configuration it was given.
func unitTemplate() string {
	return strings.Replace(packaging.Unit, packaging.UnitExecStart,
		"ExecStart={{Path | cmdEscape}}{{range Arguments}} {{. | cmd}}{{end}} $TANDEM_OPTS", 1)
}

func installService(out io.Writer, configPath string) error {
	for _, p := range packagedUnitPaths {
		if _, err := os.Stat(p); err == nil {
			return fmt.Errorf("service install: %s is installed by the tandem package; use systemctl enable --now %s", p, serviceName)
		}
	}
	if _, err := os.Lstat(localUnitPath); err == nil {
		return fmt.Errorf("service install: %s already exists (tandem service uninstall removes it)", localUnitPath)
	}
	exe, err := serviceExecutable()
	if err != nil {
		return fmt.Errorf("service install: cannot find this binary: %w", err)
	}
	if err := visibleToService("binary", exe); err != nil {
		return fmt.Errorf("service install: %w; copy tandem to /usr/local/bin first", err)
	}
	configPath, writeDefault, err := checkServiceConfig(configPath)
	if err != nil {
		return err
	}
	s, err := newKardianosService(serviceArgs(configPath), exe)
	if err != nil {
		return err
	}

	// Checks are done; from here on things change.
	created, err := ensureServiceUser()
	if err != nil {
		return fmt.Errorf("service install: %w", err)
	}
	if created {
		fmt.Fprintf(out, "created system user %s\n", serviceUser)
	}
	if writeDefault {
		if err := writeDefaultConfig(configPath); err != nil {
			return fmt.Errorf("service install: %w", err)
		}
		fmt.Fprintf(out, "wrote the default configuration to %s\n", configPath)
	}
	if err := s.Install(); err != nil {
		// kardianos writes the unit before it enables it: take a unit
		// that could not be enabled away again.
		os.Remove(localUnitPath)
		return fmt.Errorf("service install: %w", err)
	}
	fmt.Fprintf(out, "installed and enabled %s running %s with %s\nstart it with: tandem service start   (logs: journalctl -u %s)\n",
		localUnitPath, exe, configPath, serviceName)
	return nil
}

// checkServiceConfig validates the configuration the service will run
// with and returns its absolute path and whether install must write the
// packaged default there first.
func checkServiceConfig(p string) (string, bool, error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", false, config.UsageError{Err: err}
	}
	if strings.ContainsAny(abs, "$%\"\\\n") {
		// systemd would expand these in ExecStart.
		return "", false, config.UsageError{Err: fmt.Errorf("service install: --config %q: the path may not contain $, %%, \", \\ or a newline", abs)}
	}
	if err := visibleToService("--config", abs); err != nil {
		return "", false, config.UsageError{Err: fmt.Errorf("service install: %w", err)}
	}
	var cfg *config.Config
	writeDefault := false
	if _, statErr := os.Stat(abs); errors.Is(statErr, os.ErrNotExist) && abs == DefaultServiceConfig {
		writeDefault = true
		cfg, err = config.Parse([]byte(packaging.Config), abs)
	} else {
		cfg, err = config.Load(abs)
	}
	if err != nil {
		return "", false, config.UsageError{Err: err}
	}
	if err := checkServiceSettings(cfg); err != nil {
		return "", false, fmt.Errorf("service install: %s: %w", abs, err)
	}
	return abs, writeDefault, nil
}

// checkServiceSettings refuses a configuration the unit could only
// restart in vain: a data dir its sandbox makes read-only (exit 2, which
// the unit does not restart). A relative data_dir is fine: it lands under
// WorkingDirectory.
func checkServiceSettings(cfg *config.Config) error {
	if d := filepath.Clean(cfg.Node.DataDir); filepath.IsAbs(d) && d != serviceStateDir && !strings.HasPrefix(d, serviceStateDir+"/") {
		return config.UsageError{Err: fmt.Errorf("node.data_dir %s is read-only to the service "+
			"(ProtectSystem=strict leaves only %s writable): use a data_dir under %s", d, serviceStateDir, serviceStateDir)}

	}
	return nil
}

// visibleToService refuses paths the unit's sandbox hides from the
// service: PrivateTmp gives it its own /tmp, ProtectHome hides homes.
func visibleToService(what, p string) error {
	for _, dir := range []string{"/tmp", "/var/tmp", "/home", "/root", "/run/user"} {
		if p == dir || strings.HasPrefix(p, dir+"/") {
			return fmt.Errorf("%s %s is under %s, which the service cannot see", what, p, dir)
		}
	}
	return nil
}

// ensureServiceUser creates the static system user and group tandem (as
// the .deb's postinst does) unless it exists; systemd refuses to start a
// unit whose User= is missing.
func ensureServiceUser() (created bool, err error) {
	if _, err := user.Lookup(serviceUser); err == nil {
		return false, nil
	}
	var cmd *exec.Cmd
	if _, err := exec.LookPath("adduser"); err == nil {
		cmd = exec.Command("adduser", "--quiet", "--system", "--group", "--no-create-home",
			"--home", serviceStateDir, "--gecos", "tandem MQTT gateway", serviceUser)
	} else {
		shell := "/bin/false"
		for _, s := range []string{"/usr/sbin/nologin", "/sbin/nologin"} {
			if _, err := os.Stat(s); err == nil {
				shell = s
				break
			}
		}
		cmd = exec.Command("useradd", "--system", "--user-group", "--no-create-home",
			"--home-dir", serviceStateDir, "--shell", shell, "--comment", "tandem MQTT gateway", serviceUser)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return false, fmt.Errorf("creating user %s: %v: %s", serviceUser, err, strings.TrimSpace(string(out)))
	}
	return true, nil
}

// writeDefaultConfig writes the packaged configuration, 0640 root:tandem
// like the .deb's conffile: the service reads it, others do not.
func writeDefaultConfig(p string) error {
	g, err := user.LookupGroup(serviceUser)
	if err != nil {
		return err
	}
	var gid int
	if _, err := fmt.Sscan(g.Gid, &gid); err != nil {
		return fmt.Errorf("group %s: gid %q: %w", serviceUser, g.Gid, err)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(packaging.Config); err != nil {
		f.Close()
		os.Remove(p)
		return err
	}
	if err := f.Chown(0, gid); err != nil {
		f.Close()
		os.Remove(p)
		return err
	}
	return f.Close()
}

func uninstallService(out io.Writer) error {
	if _, err := os.Lstat(localUnitPath); err != nil {
		for _, p := range packagedUnitPaths {
			if _, err := os.Stat(p); err == nil {
				return fmt.Errorf("service uninstall: %s belongs to the tandem package; remove the package instead (apt remove tandem)", p)
			}
		}
		return fmt.Errorf("service uninstall: %s.service is not installed (no %s)", serviceName, localUnitPath)
	}
	s, err := newKardianosService(serviceArgs(DefaultServiceConfig), "")
	if err != nil {
		return err
	}
	// systemctl disable does not stop a running unit.
	if err := s.Stop(); err != nil {
		return fmt.Errorf("service uninstall: stopping: %w", err)
	}
	if err := s.Uninstall(); err != nil {
		return fmt.Errorf("service uninstall: %w", err)
	}
	fmt.Fprintf(out, "removed %s; kept the configuration (/etc/tandem), the data (%s) and the user %s\n",
		localUnitPath, serviceStateDir, serviceUser)
	return nil
}
