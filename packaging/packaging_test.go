package packaging

// Tests of what `make cross` and `make package` produce: the binaries, the
// .debs, and (in CI, as root) what the amd64 package does to a Debian
// system when installed, upgraded, removed and purged.

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"debug/buildinfo"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

const (
	testVersion = "1.0.0"
	testCommit  = "test0001"
	// testEpoch is SOURCE_DATE_EPOCH for the test builds: 2023-11-14
	// 22:13:20 UTC.
	testEpoch = "1700000000"
)

// arch describes one target of `make cross`.
type arch struct {
	goarch, deb string
	machine     elf.Machine
	class       elf.Class
	qemu        string // "" where the host runs it natively
}

var arches = []arch{
	{"amd64", "amd64", elf.EM_X86_64, elf.ELFCLASS64, ""},
	{"arm64", "arm64", elf.EM_AARCH64, elf.ELFCLASS64, "qemu-aarch64-static"},
	{"arm", "armhf", elf.EM_ARM, elf.ELFCLASS32, "qemu-arm-static"},
}

var scratch string // removed after the tests

func TestMain(m *testing.M) {
	var err error
	if scratch, err = os.MkdirTemp("", "tandem-packaging-test-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(scratch)
	os.Exit(code)
}

// needTool fails in CI (.ci/run installs every tool these tests use) and
// skips elsewhere.
func needTool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s not found: .ci/run should have installed it", name)
		}
		t.Skipf("%s not found (Debian: apt-get install %s)", name, debianPackageOf(name))
	}
	return p
}

func debianPackageOf(tool string) string {
	switch {
	case strings.HasPrefix(tool, "qemu-"):
		return "qemu-user-static"
	case tool == "systemd-analyze":
		return "systemd"
	case strings.HasPrefix(tool, "dpkg"):
		return "dpkg"
	}
	return tool
}

// dist is one run of `make cross package` into a directory of its own.
type dist struct {
	bin, out string
}

func (d dist) binary(a arch) string { return filepath.Join(d.bin, "tandem-linux-"+a.goarch) }

func (d dist) deb(a arch, version string) string {
	return filepath.Join(d.out, fmt.Sprintf("tandem_%s-1_%s.deb", version, a.deb))
}

// makeDist runs the Makefile's cross and package targets the way an
// installer's build would, with the output directories moved to dir.
func makeDist(dir, version string, goarches ...string) (dist, error) {
	d := dist{bin: filepath.Join(dir, "bin"), out: filepath.Join(dir, "dist")}
	cmd := exec.Command("make", "-C", "..", "--no-print-directory", "cross", "package",
		"BINDIR="+d.bin, "DISTDIR="+d.out, "VERSION="+version, "COMMIT="+testCommit,
		"SOURCE_DATE_EPOCH="+testEpoch, "CROSS_ARCHES="+strings.Join(goarches, " "))
	// A make running `go test` must not hand its jobserver to this one,
	// and nothing may pick the architecture for it.
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "GOARCH", "GOARM", "GOOS", "CGO_ENABLED":
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return d, fmt.Errorf("make cross package VERSION=%s: %v\n%s", version, err, out)
	}
	return d, nil
}

var (
	mainDistOnce sync.Once
	mainDist     dist
	mainDistErr  error
)

// built returns the three-architecture build of version testVersion,
// made once for all tests.
func built(t *testing.T) dist {
	t.Helper()
	needTool(t, "make")
	mainDistOnce.Do(func() {
		start := time.Now()
		mainDist, mainDistErr = makeDist(filepath.Join(scratch, "main"), testVersion, "amd64", "arm64", "arm")
		t.Logf("make cross package: %v", time.Since(start).Round(time.Millisecond))
	})
	if mainDistErr != nil {
		t.Fatal(mainDistErr)
	}
	return mainDist
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), "TZ=UTC", "LC_ALL=C")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// runVersion runs `tandem version` natively or under qemu-user and checks
// that the binary reports the version, commit and architecture it was
// built for.
func runVersion(t *testing.T, bin string, a arch, version string) {
	t.Helper()
	var out string
	if a.qemu == "" {
		out = run(t, bin, "version")
	} else {
		out = run(t, needTool(t, a.qemu), bin, "version")
	}
	want := regexp.MustCompile(`^tandem ` + regexp.QuoteMeta(version) + ` \(commit ` + testCommit + `, go[0-9.]+, linux/` + a.goarch + `\)\n$`)
	if !want.MatchString(out) {
		t.Errorf("%s version: %q, want %s", bin, out, want)
	}
}

func TestUnitHasExecStartLine(t *testing.T) {
	if strings.Count(Unit, "\n"+UnitExecStart+"\n") != 1 {
		t.Fatalf("tandem.service has no line %q (tandem service install replaces it)", UnitExecStart)
	}
	if Config == "" {
		t.Fatal("tandem.yaml is not embedded")
	}
}

// The issue asks for an exposure of at most 2.0 ("OK") in systemd's own
// review of the unit's sandboxing.
func TestUnitSecurityExposure(t *testing.T) {
	analyze := needTool(t, "systemd-analyze")
	cmd := exec.Command(analyze, "security", "--offline=true", "--no-pager", "tandem.service")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze security: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`Overall exposure level for tandem.service: ([0-9.]+) (\w+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no overall exposure in:\n%s", out)
	}
	score, _ := strconv.ParseFloat(string(m[1]), 64)
	t.Logf("systemd-analyze security --offline=true: %s %s", m[1], m[2])
	if score > 2.0 {
		t.Errorf("exposure %.1f %s, want at most 2.0:\n%s", score, m[2], out)
	}
}

// systemd-analyze verify checks the unit's syntax and that its commands
// exist, so ExecStart is pointed at a built binary.
func TestUnitVerifies(t *testing.T) {
	analyze := needTool(t, "systemd-analyze")
	d := built(t)
	unit := filepath.Join(t.TempDir(), "tandem.service")
	body := strings.Replace(Unit, "ExecStart=/usr/bin/tandem ", "ExecStart="+d.binary(arches[0])+" ", 1)
	if err := os.WriteFile(unit, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(analyze, "verify", "--man=false", unit).CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// make cross: static, stripped, CGO-free, version-stamped binaries for
// amd64, arm64 and ARMv7 that run (under qemu-user for ARM) and report
// their architecture.
func TestCrossBinaries(t *testing.T) {
	d := built(t)
	for _, a := range arches {
		t.Run(a.goarch, func(t *testing.T) {
			p := d.binary(a)
			f, err := elf.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if f.Machine != a.machine || f.Class != a.class {
				t.Errorf("ELF %v %v, want %v %v", f.Machine, f.Class, a.machine, a.class)
			}
			for _, prog := range f.Progs {
				if prog.Type == elf.PT_INTERP || prog.Type == elf.PT_DYNAMIC {
					t.Errorf("not static: has %v", prog.Type)
				}
			}
			if f.Section(".symtab") != nil {
				t.Error("not stripped: has .symtab")
			}
			bi, err := buildinfo.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			settings := map[string]string{}
			for _, s := range bi.Settings {
				settings[s.Key] = s.Value
			}
			want := map[string]string{"GOOS": "linux", "GOARCH": a.goarch, "CGO_ENABLED": "0", "-trimpath": "true"}
			if a.goarch == "arm" {
				want["GOARM"] = "7"
			}
			for k, v := range want {
				if settings[k] != v {
					t.Errorf("built with %s=%q, want %q", k, settings[k], v)
				}
			}
			// -trimpath keeps -ldflags out of the build info: the version
			// stamp is checked by running the binary.
			st, _ := os.Stat(p)
			t.Logf("%s: %.1f MiB", filepath.Base(p), float64(st.Size())/(1<<20))
			runVersion(t, p, a, testVersion)
		})
	}
}

// debEntry is a line of `dpkg-deb -c`.
type debEntry struct{ mode, owner, date string }

func debContents(t *testing.T, deb string) map[string]debEntry {
	t.Helper()
	m := map[string]debEntry{}
	sc := bufio.NewScanner(strings.NewReader(run(t, "dpkg-deb", "-c", deb)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 6 {
			t.Fatalf("dpkg-deb -c: %q", sc.Text())
		}
		owner := strings.NewReplacer("0/0", "root/root").Replace(f[1])
		m[strings.TrimPrefix(f[5], ".")] = debEntry{mode: f[0], owner: owner, date: f[3] + " " + f[4]}
	}
	return m
}

// packagedFiles are the files (not directories) each .deb holds, with
// their modes.
var packagedFiles = map[string]string{
	"/usr/bin/tandem":                           "-rwxr-xr-x",
	"/lib/systemd/system/tandem.service":        "-rw-r--r--",
	"/etc/tandem/tandem.yaml":                   "-rw-r-----",
	"/etc/default/tandem":                       "-rw-r--r--",
	"/usr/share/doc/tandem/copyright":           "-rw-r--r--",
	"/usr/share/doc/tandem/changelog.Debian.gz": "-rw-r--r--",
	"/usr/share/man/man1/tandem.1.gz":           "-rw-r--r--",
	"/usr/share/lintian/overrides/tandem":       "-rw-r--r--",
}

// make package: one .deb per architecture with the right Architecture,
// exactly the files above owned by root, the conffiles and maintainer
// scripts of packaging/, every time stamp at SOURCE_DATE_EPOCH, and a
// binary that runs on its architecture.
func TestDebPackages(t *testing.T) {
	needTool(t, "dpkg-deb")
	d := built(t)
	for _, a := range arches {
		t.Run(a.deb, func(t *testing.T) {
			deb := d.deb(a, testVersion)
			fields := map[string]string{}
			for _, f := range []string{"Package", "Version", "Architecture", "Depends", "Section", "Priority", "Maintainer"} {
				fields[f] = strings.TrimSpace(run(t, "dpkg-deb", "-f", deb, f))
			}
			want := map[string]string{"Package": "tandem", "Version": testVersion + "-1", "Architecture": a.deb,
				"Depends": "adduser", "Section": "net", "Priority": "optional"}
			for k, v := range want {
				if fields[k] != v {
					t.Errorf("%s: %q, want %q", k, fields[k], v)
				}
			}

			contents := debContents(t, deb)
			for p, e := range contents {
				if e.owner != "root/root" {
					t.Errorf("%s owned by %s", p, e.owner)
				}
				if e.date != "2023-11-14 22:13" {
					t.Errorf("%s dated %s, want SOURCE_DATE_EPOCH (2023-11-14 22:13 UTC)", p, e.date)
				}
				if strings.HasSuffix(p, "/") {
					if e.mode != "drwxr-xr-x" {
						t.Errorf("directory %s: %s", p, e.mode)
					}
					continue
				}
				if mode, ok := packagedFiles[p]; !ok {
					t.Errorf("unexpected file %s", p)
				} else if e.mode != mode {
					t.Errorf("%s: mode %s, want %s", p, e.mode, mode)
				}
			}
			for p := range packagedFiles {
				if _, ok := contents[p]; !ok {
					t.Errorf("missing %s", p)
				}
			}
			for _, p := range []string{"/var/lib/tandem/", "/etc/systemd/"} {
				if _, ok := contents[p]; ok {
					t.Errorf("%s is shipped: postinst creates the data dir and deb-systemd-helper the links", p)
				}
			}

			ctrl := t.TempDir()
			run(t, "dpkg-deb", "-e", deb, ctrl)
			if got := readFile(t, filepath.Join(ctrl, "conffiles")); got != "/etc/default/tandem\n/etc/tandem/tandem.yaml\n" {
				t.Errorf("conffiles:\n%s", got)
			}
			for _, s := range []string{"postinst", "prerm", "postrm"} {
				st, err := os.Stat(filepath.Join(ctrl, s))
				if err != nil {
					t.Fatal(err)
				}
				if st.Mode().Perm() != 0o755 || readFile(t, filepath.Join(ctrl, s)) != readFile(t, filepath.Join("deb", s)) {
					t.Errorf("%s is not packaging/deb/%s with mode 0755 (%v)", s, s, st.Mode())
				}
				run(t, "sh", "-n", filepath.Join(ctrl, s))
			}

			root := t.TempDir()
			run(t, "dpkg-deb", "-x", deb, root)
			for src, dst := range map[string]string{"tandem.service": "lib/systemd/system/tandem.service",
				"tandem.yaml": "etc/tandem/tandem.yaml", "tandem.default": "etc/default/tandem"} {
				if readFile(t, src) != readFile(t, filepath.Join(root, dst)) {
					t.Errorf("/%s is not packaging/%s", dst, src)
				}
			}
			if readFile(t, filepath.Join(root, "usr/bin/tandem")) != readFile(t, d.binary(a)) {
				t.Errorf("/usr/bin/tandem is not %s", d.binary(a))
			}
			runVersion(t, filepath.Join(root, "usr/bin/tandem"), a, testVersion)
			changelog := run(t, "sh", "-c", "zcat "+filepath.Join(root, "usr/share/doc/tandem/changelog.Debian.gz"))
			if !strings.HasPrefix(changelog, "tandem ("+testVersion+"-1) ") {
				t.Errorf("changelog does not start with this version:\n%s", changelog)
			}
			st, _ := os.Stat(deb)
			t.Logf("%s: %.1f MiB", filepath.Base(deb), float64(st.Size())/(1<<20))
		})
	}
}

// The same commit and SOURCE_DATE_EPOCH give the same bytes: binaries and
// packages alike.
func TestDebReproducible(t *testing.T) {
	needTool(t, "make")
	d1 := built(t)
	d2, err := makeDist(t.TempDir(), testVersion, "amd64", "arm64", "arm")
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range arches {
		for _, pair := range [][2]string{{d1.binary(a), d2.binary(a)}, {d1.deb(a, testVersion), d2.deb(a, testVersion)}} {
			if sha256.Sum256([]byte(readFile(t, pair[0]))) != sha256.Sum256([]byte(readFile(t, pair[1]))) {
				t.Errorf("%s differs between two builds", filepath.Base(pair[0]))
			}
		}
	}
}

// lintian, Debian's package checker, finds no error and no warning.
func TestLintian(t *testing.T) {
	lintian := needTool(t, "lintian")
	d := built(t)
	args := []string{"--fail-on", "error,warning"}
	for _, a := range arches {
		args = append(args, d.deb(a, testVersion))
	}
	out, err := exec.Command(lintian, args...).CombinedOutput()
	out = bytes.ReplaceAll(out, []byte("running with root privileges is not recommended!\n"), nil)
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Fatalf("lintian: %v\n%s", err, out)
	}
}

// fileID is what a check compares to prove a file was kept: content,
// mode and owner.
type fileID struct {
	sum      [32]byte
	mode     os.FileMode
	uid, gid uint32
	isDir    bool
}

func identify(t *testing.T, p string) fileID {
	t.Helper()
	st, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	id := fileID{mode: st.Mode(), uid: sys.Uid, gid: sys.Gid, isDir: st.IsDir()}
	if st.Mode().IsRegular() {
		id.sum = sha256.Sum256([]byte(readFile(t, p)))
	}
	return id
}

// tree identifies every file under dir.
func tree(t *testing.T, dir string) map[string]fileID {
	t.Helper()
	m := map[string]fileID{}
	err := filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		m[p] = identify(t, p)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func exists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}

func pkgStatus(t *testing.T) string {
	t.Helper()
	out, _ := exec.Command("dpkg-query", "-W", "-f", "${db:Status-Abbrev}${Version}", "tandem").Output()
	return strings.TrimSpace(string(out))
}

// runAsService starts the installed binary as systemd would start the
// unit (as the user tandem, in /var/lib/tandem, with ExecStart's
// arguments; $TANDEM_OPTS moves the listeners to free loopback ports),
// waits until it serves, and stops it with SIGTERM.
func runAsService(t *testing.T) {
	t.Helper()
	unit := readFile(t, "/lib/systemd/system/tandem.service")
	m := regexp.MustCompile(`(?m)^ExecStart=(.*)$`).FindStringSubmatch(unit)
	if m == nil {
		t.Fatal("installed unit has no ExecStart")
	}
	opts := "--mqtt 127.0.0.1:0 --http 127.0.0.1:0 --peer 127.0.0.1:0"
	argv := strings.Fields(strings.Replace(m[1], "$TANDEM_OPTS", opts, 1))
	// The packaged config turns mDNS on: the daemon runs in a network
	// namespace of its own, so nothing it announces leaves this test.
	host := netns.New(t, 1).Hosts[0]
	cmd := host.Command("setpriv", append([]string{"--reuid=tandem", "--regid=tandem", "--init-groups", "--"}, argv...)...)
	cmd.Dir = "/var/lib/tandem"
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	started := make(chan bool, 1)
	var log bytes.Buffer
	go func() {
		sc := bufio.NewScanner(stderr)
		ok := false
		for sc.Scan() {
			log.WriteString(sc.Text() + "\n")
			if !ok && strings.Contains(sc.Text(), `msg="gateway started"`) {
				ok = true
				started <- true
			}
		}
		if !ok {
			started <- false
		}
	}()
	select {
	case ok := <-started:
		if !ok {
			cmd.Wait()
			t.Fatalf("%s exited before serving:\n%s", strings.Join(argv, " "), log.String())
		}
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("%s did not start within 30 s", strings.Join(argv, " "))
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("stopping the installed daemon: %v\n%s", err, log.String())
	}
}

// The amd64 package on this Debian, for real: install creates the user,
// the state directory, the configuration's group, and enables the unit
// (systemd is not running here, so nothing is started); the daemon runs
// from the installed files as the service would; an upgrade keeps the
// data and the edited configuration; remove keeps both; purge leaves
// nothing of the package on the system.
func TestDebInstallUpgradeRemovePurge(t *testing.T) {
	testutil.SystemTest(t, "installs and purges the tandem package on this system")
	dpkg := needTool(t, "dpkg")
	analyze := needTool(t, "systemd-analyze")
	needTool(t, "setpriv")
	if runtime.GOARCH != "amd64" {
		t.Skipf("installs the amd64 package; this is %s", runtime.GOARCH)
	}
	if s := pkgStatus(t); s != "" && !strings.HasPrefix(s, "un") && !strings.HasPrefix(s, "pn") {
		t.Fatalf("the tandem package is on this system already (%s); this test would replace it", s)
	}
	for _, p := range []string{"/etc/tandem", "/var/lib/tandem", "/etc/systemd/system/tandem.service"} {
		if exists(p) {
			t.Fatalf("%s exists already; this test would remove it", p)
		}
	}
	_, err := user.Lookup("tandem")
	hadUser := err == nil
	t.Cleanup(func() {
		exec.Command(dpkg, "--purge", "tandem").Run()
		// They did not exist before (checked above); a failed purge must
		// not leave them to the next run.
		os.RemoveAll("/etc/tandem")
		os.RemoveAll("/var/lib/tandem")
		if !hadUser {
			exec.Command("userdel", "tandem").Run()
			exec.Command("groupdel", "tandem").Run()
		}
	})
	v1 := built(t).deb(arches[0], testVersion)
	next, err := makeDist(t.TempDir(), "1.0.1", "amd64")
	if err != nil {
		t.Fatal(err)
	}
	v2 := next.deb(arches[0], "1.0.1")
	dpkgDo := func(args ...string) {
		t.Helper()
		cmd := exec.Command(dpkg, args...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("dpkg %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}

	// Install.
	dpkgDo("-i", v1)
	if s := pkgStatus(t); s != "ii "+testVersion+"-1" {
		t.Fatalf("after install: %q", s)
	}
	u, err := user.Lookup("tandem")
	if err != nil {
		t.Fatalf("postinst did not create the user: %v", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	g, err := user.LookupGroup("tandem")
	if err != nil || u.Gid != g.Gid {
		t.Fatalf("user tandem's group: %v %v", g, err)
	}
	gid, _ := strconv.Atoi(g.Gid)
	if uid >= 1000 || u.HomeDir != "/var/lib/tandem" {
		t.Errorf("user tandem: uid %d home %s, want a system uid and /var/lib/tandem", uid, u.HomeDir)
	}
	if pw := run(t, "getent", "passwd", "tandem"); !strings.HasSuffix(strings.TrimSpace(pw), ":/usr/sbin/nologin") {
		t.Errorf("user tandem can log in: %s", pw)
	}
	for p, want := range map[string]fileID{
		"/etc/tandem/tandem.yaml": {mode: 0o640, uid: 0, gid: uint32(gid)},
		"/etc/default/tandem":     {mode: 0o644, uid: 0, gid: 0},
		"/var/lib/tandem":         {mode: os.ModeDir | 0o750, uid: uint32(uid), gid: uint32(gid), isDir: true},
	} {
		got := identify(t, p)
		if got.mode != want.mode || got.uid != want.uid || got.gid != want.gid {
			t.Errorf("%s: mode %v %d:%d, want %v %d:%d", p, got.mode, got.uid, got.gid, want.mode, want.uid, want.gid)
		}
	}
	if readFile(t, "/lib/systemd/system/tandem.service") != Unit || readFile(t, "/etc/tandem/tandem.yaml") != Config {
		t.Error("the installed unit or configuration is not packaging/'s")
	}
	if out, err := exec.Command(analyze, "verify", "--man=false", "/lib/systemd/system/tandem.service").CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify of the installed unit: %v\n%s", err, out)
	}
	if dst, err := os.Readlink("/etc/systemd/system/multi-user.target.wants/tandem.service"); err != nil || dst != "/lib/systemd/system/tandem.service" {
		t.Errorf("the unit is not enabled: %q %v", dst, err)
	}
	run(t, "setpriv", "--reuid=tandem", "--regid=tandem", "--init-groups", "/usr/bin/tandem", "check", "--config", "/etc/tandem/tandem.yaml")
	runAsService(t)
	if !exists("/var/lib/tandem/tandem.db") {
		t.Fatal("the daemon run as the service left no log in /var/lib/tandem")
	}
	data := tree(t, "/var/lib/tandem")
	for p, id := range data {
		if id.uid != uint32(uid) {
			t.Errorf("%s is not owned by tandem", p)
		}
	}

	// Edit the configuration, then upgrade.
	edited := strings.Replace(Config, "  level: info\n", "  level: debug\n", 1) + "# edited on the gateway\n"
	if edited == Config+"# edited on the gateway\n" {
		t.Fatal("packaged tandem.yaml has no `level: info` line to edit")
	}
	if err := os.WriteFile("/etc/tandem/tandem.yaml", []byte(edited), 0o640); err != nil {
		t.Fatal(err)
	}
	config := identify(t, "/etc/tandem/tandem.yaml")
	dpkgDo("-i", v2)
	if s := pkgStatus(t); s != "ii 1.0.1-1" {
		t.Fatalf("after upgrade: %q", s)
	}
	if out := run(t, "/usr/bin/tandem", "version"); !strings.HasPrefix(out, "tandem 1.0.1 ") {
		t.Errorf("after upgrade: %s", out)
	}
	checkKept := func(when string) {
		t.Helper()
		if got := identify(t, "/etc/tandem/tandem.yaml"); got != config {
			t.Errorf("%s: the edited configuration changed (%+v, was %+v)", when, got, config)
		}
		if got := tree(t, "/var/lib/tandem"); !equalTrees(got, data) {
			t.Errorf("%s: /var/lib/tandem changed:\n%v\nwas\n%v", when, got, data)
		}
		for _, p := range []string{"/etc/tandem/tandem.yaml.dpkg-dist", "/etc/tandem/tandem.yaml.dpkg-new", "/etc/tandem/tandem.yaml.dpkg-old"} {
			if exists(p) {
				t.Errorf("%s: %s exists", when, p)
			}
		}
	}
	checkKept("after upgrade")
	runAsService(t) // the new binary opens the old log
	data = tree(t, "/var/lib/tandem")

	// Remove: the binary and the unit go, configuration and data stay.
	dpkgDo("-r", "tandem")
	if s := pkgStatus(t); s != "rc 1.0.1-1" {
		t.Fatalf("after remove: %q", s)
	}
	for _, p := range []string{"/usr/bin/tandem", "/lib/systemd/system/tandem.service"} {
		if exists(p) {
			t.Errorf("after remove: %s is still there", p)
		}
	}
	if !exists("/etc/default/tandem") {
		t.Error("remove deleted /etc/default/tandem")
	}
	checkKept("after remove")
	if _, err := user.Lookup("tandem"); err != nil {
		t.Error("remove deleted the user")
	}

	// Installing again over the kept configuration keeps it too.
	dpkgDo("-i", v2)
	checkKept("after reinstall")
	if dst, err := os.Readlink("/etc/systemd/system/multi-user.target.wants/tandem.service"); err != nil || dst != "/lib/systemd/system/tandem.service" {
		t.Errorf("reinstall: the unit is not enabled: %q %v", dst, err)
	}

	// Purge: nothing of the package is left (the user stays, as Debian
	// keeps system users); a file an administrator added to /etc/tandem
	// is kept, and named.
	if err := os.WriteFile("/etc/tandem/users", []byte("sensor:$2a$10$x\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	purge := exec.Command(dpkg, "--purge", "tandem")
	purge.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	if out, err := purge.CombinedOutput(); err != nil {
		t.Fatalf("dpkg --purge: %v\n%s", err, out)
	} else if !strings.Contains(string(out), "kept /etc/tandem") || !strings.Contains(string(out), "users") {
		t.Errorf("purge did not say it kept /etc/tandem/users:\n%s", out)
	}
	if !exists("/etc/tandem/users") {
		t.Error("purge deleted a users file an administrator added")
	}
	if err := os.RemoveAll("/etc/tandem"); err != nil {
		t.Fatal(err)
	}
	if s := pkgStatus(t); s != "" && !strings.HasPrefix(s, "un") && !strings.HasPrefix(s, "pn") {
		t.Errorf("after purge: %q", s)
	}
	var left []string
	for _, dir := range []string{"/etc", "/lib/systemd", "/usr/lib/systemd", "/var/lib", "/usr/bin", "/usr/share/doc", "/usr/share/man/man1", "/usr/share/lintian"} {
		filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
			if err != nil {
				return nil
			}
			if strings.Contains(filepath.Base(p), "tandem") {
				left = append(left, p)
				if info.IsDir() {
					return filepath.SkipDir
				}
			}
			return nil
		})
	}
	if len(left) > 0 {
		t.Errorf("after purge these are left:\n%s", strings.Join(left, "\n"))
	}
}

func equalTrees(a, b map[string]fileID) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
