package cli

import (
	"errors"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/kardianos/service"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/packaging"
)

// chooseServiceSystem makes kardianos use the system named name (as if
// it had detected it) until the test ends.
func chooseServiceSystem(t *testing.T, name string) {
	t.Helper()
	all := service.AvailableSystems()
	var chosen service.System
	for _, s := range all {
		if s.String() == name {
			chosen = s
		}
	}
	if chosen == nil {
		t.Fatalf("kardianos has no system %q", name)
	}
	service.ChooseSystem(detected{chosen})
	t.Cleanup(func() { service.ChooseSystem(all...) })
}

// detected is a kardianos System whose detection always says yes.
type detected struct{ service.System }

func (detected) Detect() bool { return true }

// pathState records whether each path exists, to prove a refusal changed
// nothing.
func pathState(paths ...string) map[string]bool {
	m := map[string]bool{}
	for _, p := range paths {
		_, err := os.Lstat(p)
		m[p] = err == nil
	}
	return m
}

func userExists(name string) bool {
	_, err := user.Lookup(name)
	return err == nil
}

// Where systemd is not the running init, kardianos falls back to SysV,
// whose detection says yes everywhere. Every action must refuse, exit 1,
// say why, and leave the system as it was.
func TestServiceRefusedWithoutSystemd(t *testing.T) {
	touched := []string{localUnitPath, "/etc/init.d/tandem", DefaultServiceConfig, "/etc/tandem"}
	run := func(t *testing.T, platform string) {
		before, hadUser := pathState(touched...), userExists(serviceUser)
		t.Cleanup(func() {
			// Only a broken refusal leaves these; do not leave them behind.
			for p, existed := range before {
				if _, err := os.Lstat(p); err == nil && !existed {
					os.RemoveAll(p)
				}
			}
		})
		for _, args := range [][]string{
			{"service", "install"},
			{"service", "install", "--config", "/etc/tandem/other.yaml"},
			{"service", "uninstall"}, {"service", "start"}, {"service", "stop"},
			{"service", "restart"}, {"service", "status"},
		} {
			code, out, stderr := runMain(t, args...)
			if code != ExitFailure || !strings.Contains(stderr, "systemd is not the running init system") ||
				!strings.Contains(stderr, platform) {
				t.Errorf("%v: exit %d, want 1 with a plain reason naming %q; stdout %q stderr %q", args, code, platform, out, stderr)
			}
		}
		if after := pathState(touched...); !mapsEqual(before, after) {
			t.Errorf("a refused service command changed the system: before %v, after %v", before, after)
		}
		if !hadUser && userExists(serviceUser) {
			t.Errorf("a refused service install created the user %s", serviceUser)
		}
	}
	t.Run("SysV fallback", func(t *testing.T) {
		chooseServiceSystem(t, "unix-systemv")
		run(t, "unix-systemv")
	})
	t.Run("this host", func(t *testing.T) {
		p := service.Platform()
		if p == systemdPlatform {
			t.Skip("systemd is the running init on this host: the refusal is covered by the SysV subtest")
		}
		run(t, p)
	})
}

func mapsEqual(a, b map[string]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestServiceUsageErrors(t *testing.T) {
	for _, args := range [][]string{{"service"}, {"service", "bogus"}, {"service", "start", "extra"}} {
		if code, _, stderr := runMain(t, args...); code != ExitUsage {
			t.Errorf("%v: exit %d, want 2: %s", args, code, stderr)
		}
	}
}

// The unit install writes is the packaged one but for ExecStart, which
// kardianos fills in with this binary and its arguments.
func TestServiceUnitTemplate(t *testing.T) {
	if strings.Count(packaging.Unit, packaging.UnitExecStart+"\n") != 1 {
		t.Fatalf("packaging/tandem.service has no line %q", packaging.UnitExecStart)
	}
	tpl := unitTemplate()
	if strings.Count(tpl, "{{") != 4 || !strings.Contains(tpl, "ExecStart={{Path | cmdEscape}}{{range Arguments}} {{. | cmd}}{{end}} $TANDEM_OPTS\n") {
		t.Fatalf("template's ExecStart is not kardianos' Path and Arguments:\n%s", tpl)
	}
	a, b := strings.Split(packaging.Unit, "\n"), strings.Split(tpl, "\n")
	if len(a) != len(b) {
		t.Fatalf("template has %d lines, the unit %d", len(b), len(a))
	}
	for i := range a {
		if a[i] != b[i] && !strings.HasPrefix(a[i], "ExecStart=") {
			t.Errorf("line %d differs: unit %q, template %q", i+1, a[i], b[i])
		}
	}
}

func TestServiceConfigChecks(t *testing.T) {
	for _, p := range []string{"/tmp/tandem.yaml", "/home/pi/tandem.yaml", "/root/t.yaml", "/etc/tandem/$x.yaml", "/etc/tandem/50%.yaml"} {
		_, _, err := checkServiceConfig(p)
		var ue config.UsageError
		if err == nil || !errors.As(err, &ue) {
			t.Errorf("--config %s: %v, want a usage error", p, err)
		}
	}
	for _, tc := range []struct {
		yaml, want string
	}{
		{"node:\n  data_dir: /srv/tandem\n", "read-only to the service"},
		{"node:\n  data_dir: /var/lib/tandemx\n", "read-only to the service"},
		{"storage:\n  flush: interval\n  max_bytes: 1GiB\n", ""},
		{"node:\n  data_dir: /var/lib/tandem\n", ""},
		{"node:\n  data_dir: /var/lib/tandem/gw\n", ""},
		{"node:\n  data_dir: ./data\n", ""},
	} {
		cfg, err := config.Parse([]byte(tc.yaml), "t.yaml")
		if err != nil {
			t.Fatal(err)
		}
		err = checkServiceSettings(cfg)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%q: %v, want %q", tc.yaml, err, tc.want)
		}
	}
	cfg, err := config.Parse([]byte(packaging.Config), "packaging/tandem.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := checkServiceSettings(cfg); err != nil {
		t.Errorf("the packaged configuration cannot run as the service: %v", err)
	}
}

// fakeSystemctl puts a systemctl on PATH that logs its arguments and
// answers is-active with $FAKE_SYSTEMCTL_ACTIVE (default "active"); it
// returns the log's path.
func fakeSystemctl(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	log := filepath.Join(dir, "log")
	script := `#!/bin/sh
echo "$*" >> '` + log + `'
case "$1" in
--version) echo "systemd 252 (252.38-1~deb12u1)" ;;
is-active) echo "${FAKE_SYSTEMCTL_ACTIVE:-active}"; [ "${FAKE_SYSTEMCTL_ACTIVE:-active}" = active ] ;;
list-unit-files) echo "tandem.service enabled enabled" ;;
esac
`
	if err := os.WriteFile(filepath.Join(dir, "systemctl"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+":"+os.Getenv("PATH"))
	return log
}

func readLog(t *testing.T, p string) []string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	os.Remove(p)
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if l != "" && l != "--version" {
			lines = append(lines, l)
		}
	}
	return lines
}

// install, control and uninstall on systemd, with kardianos' systemd
// backend and a systemctl that records what it is asked: the unit lands in
// /etc/systemd/system as the packaged one with this binary in ExecStart,
// systemd-analyze accepts it, the user and the default configuration are
// created, and uninstall keeps configuration, data and user.
func TestServiceInstallOnSystemd(t *testing.T) {
	testutil.SystemTest(t, "changes this system (a unit in /etc/systemd/system, the user tandem, /etc/tandem)")
	analyze := testutil.NeedTool(t, "systemd-analyze")
	chooseServiceSystem(t, systemdPlatform)
	log := fakeSystemctl(t)

	if _, err := os.Lstat(localUnitPath); err == nil {
		t.Fatalf("%s exists already; this test would replace it", localUnitPath)
	}
	hadUser := userExists(serviceUser)
	_, err := os.Stat(DefaultServiceConfig)
	hadConfig := err == nil
	_, err = os.Stat("/etc/tandem")
	hadConfigDir := err == nil
	t.Cleanup(func() {
		os.Remove(localUnitPath)
		if !hadConfig {
			os.Remove(DefaultServiceConfig)
		}
		if !hadConfigDir {
			os.Remove("/etc/tandem")
		}
		if !hadUser && userExists(serviceUser) {
			if out, err := exec.Command("deluser", "--system", "--quiet", serviceUser).CombinedOutput(); err != nil {
				t.Errorf("removing the user the test created: %v %s", err, out)
			}
		}
	})

	// The unit runs the binary install runs from; a test binary lives in
	// /tmp, which the unit's PrivateTmp hides, so use a copy elsewhere.
	exeDir, err := os.MkdirTemp("/var/lib", "tandem-service-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(exeDir) })
	exe := filepath.Join(exeDir, "tandem")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", self, exe).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, out)
	}
	orig := serviceExecutable
	serviceExecutable = func() (string, error) { return exe, nil }
	t.Cleanup(func() { serviceExecutable = orig })
	pkgUnit := filepath.Join(t.TempDir(), "tandem.service")
	origPaths := packagedUnitPaths
	packagedUnitPaths = []string{pkgUnit}
	t.Cleanup(func() { packagedUnitPaths = origPaths })

	code, out, stderr := runMain(t, "service", "install")
	if code != ExitOK {
		t.Fatalf("install: exit %d: %s %s", code, out, stderr)
	}
	t.Logf("tandem service install:\n%s", out)
	if got := readLog(t, log); strings.Join(got, "|") != "enable tandem.service|daemon-reload" {
		t.Errorf("install ran systemctl %q, want enable then daemon-reload", got)
	}
	unit, err := os.ReadFile(localUnitPath)
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Replace(packaging.Unit, packaging.UnitExecStart,
		"ExecStart="+exe+` "run" "--config" "/etc/tandem/tandem.yaml" $TANDEM_OPTS`, 1)
	if string(unit) != want {
		t.Errorf("installed unit:\n%s\nwant:\n%s", unit, want)
	}
	if out, err := exec.Command(analyze, "verify", localUnitPath).CombinedOutput(); err != nil {
		t.Errorf("systemd-analyze verify %s: %v\n%s", localUnitPath, err, out)
	}
	if !userExists(serviceUser) {
		t.Errorf("user %s was not created", serviceUser)
	}
	if !hadUser && !strings.Contains(out, "created system user tandem") {
		t.Errorf("install did not say it created the user: %s", out)
	}
	if !hadConfig {
		checkConfigFile(t, DefaultServiceConfig, packaging.Config)
	}

	if code, _, stderr := runMain(t, "service", "install"); code != ExitFailure || !strings.Contains(stderr, "already exists") {
		t.Errorf("second install: exit %d %s", code, stderr)
	}
	for _, action := range []string{"start", "stop", "restart"} {
		if code, out, stderr := runMain(t, "service", action); code != ExitOK {
			t.Errorf("%s: exit %d %s %s", action, code, out, stderr)
		}
		if got := readLog(t, log); len(got) != 1 || got[0] != action+" tandem.service" {
			t.Errorf("%s ran systemctl %q", action, got)
		}
	}
	if code, out, _ := runMain(t, "service", "status"); code != ExitOK || !strings.Contains(out, "running") {
		t.Errorf("status while active: exit %d %q", code, out)
	}
	t.Setenv("FAKE_SYSTEMCTL_ACTIVE", "inactive")
	if code, out, _ := runMain(t, "service", "status"); code != ExitFailure || !strings.Contains(out, "stopped") {
		t.Errorf("status while inactive: exit %d %q", code, out)
	}
	readLog(t, log)

	// With the package's unit present, install and uninstall leave it alone.
	if err := os.WriteFile(pkgUnit, []byte(packaging.Unit), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Rename(localUnitPath, localUnitPath+".test")
	code, _, stderr = runMain(t, "service", "install")
	if code != ExitFailure || !strings.Contains(stderr, "installed by the tandem package") {
		t.Errorf("install over the package's unit: exit %d %s", code, stderr)
	}
	if code, _, stderr := runMain(t, "service", "uninstall"); code != ExitFailure || !strings.Contains(stderr, "belongs to the tandem package") {
		t.Errorf("uninstall of the package's unit: exit %d %s", code, stderr)
	}
	os.Rename(localUnitPath+".test", localUnitPath)
	os.Remove(pkgUnit)
	if got := readLog(t, log); len(got) != 0 {
		t.Errorf("refused commands ran systemctl %q", got)
	}

	code, out, stderr = runMain(t, "service", "uninstall")
	if code != ExitOK {
		t.Fatalf("uninstall: exit %d %s %s", code, out, stderr)
	}
	if got := readLog(t, log); strings.Join(got, "|") != "stop tandem.service|disable tandem.service|daemon-reload" {
		t.Errorf("uninstall ran systemctl %q, want stop, disable, daemon-reload", got)
	}
	if _, err := os.Lstat(localUnitPath); err == nil {
		t.Errorf("uninstall left %s", localUnitPath)
	}
	if _, err := os.Stat(DefaultServiceConfig); err != nil {
		t.Errorf("uninstall removed the configuration: %v", err)
	}
	if !userExists(serviceUser) {
		t.Error("uninstall removed the user")
	}
	if code, _, stderr := runMain(t, "service", "uninstall"); code != ExitFailure || !strings.Contains(stderr, "not installed") {
		t.Errorf("second uninstall: exit %d %s", code, stderr)
	}
}

// checkConfigFile checks a configuration install wrote: the content, and
// 0640 root:tandem so only the service's group reads it.
func checkConfigFile(t *testing.T, p, content string) {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != content {
		t.Errorf("%s is not the packaged configuration", p)
	}
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	g, err := user.LookupGroup(serviceUser)
	if err != nil {
		t.Fatal(err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	if st.Mode().Perm() != 0o640 || sys.Uid != 0 || g.Gid != strconv.FormatUint(uint64(sys.Gid), 10) {
		t.Errorf("%s: mode %v uid %d gid %d, want 0640 root:tandem (%s)", p, st.Mode().Perm(), sys.Uid, sys.Gid, g.Gid)
	}
}
