package e2e

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
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

// The .deb upgrade of a running member: the previous release's package
// and this tree's, built as `make package` builds them, the old one
// installed and run as the service of one member of a 3-gateway cluster,
// then `dpkg -i` of the new one over it under load.
//
// There is no systemd as PID 1 here (nor in CI), and what a .deb does on
// upgrade is decided by its maintainer scripts, which run systemctl
// through init-system-helpers only where /run/systemd/system exists. So
// dpkg runs in a mount namespace of its own with a tmpfs holding an empty
// /run/systemd/system (the machine's /run is untouched; a policy-rc.d
// that forbids starts, as container images have, is overlaid there by
// one that allows them), and with a `systemctl` first on PATH (this test
// binary as runHelper's systemctl helper) that hands every call to
// serviceManager, a service manager in the test: it runs the installed
// unit as systemd would (its ExecStart, User, Group, WorkingDirectory,
// EnvironmentFile, UMask, TimeoutStopSec; the unit as of the last
// daemon-reload), on a netns host, and records each call. The maintainer scripts, dpkg and
// init-system-helpers (deb-systemd-invoke, deb-systemd-helper) are the
// real ones; only the service manager under them is the test's.

// TANDEM_E2E_SYSTEMCTL names the unix socket of the test's service
// manager for the `systemctl` helper (runHelper).
const systemctlSockEnv = "TANDEM_E2E_SYSTEMCTL"

// systemctlReply is the service manager's answer to one systemctl call.
type systemctlReply struct {
	Code   int    `json:"code"`
	Stdout string `json:"stdout"`
	Stderr string `json:"stderr"`
	// Exec, when set, is the real systemctl to run instead: offline calls
	// (--root=) touch only files, which the real one does right.
	Exec string `json:"exec"`
}

// fakeSystemctl is the `systemctl` helper: it sends its arguments to the
// service manager named by TANDEM_E2E_SYSTEMCTL and prints its answer.
func fakeSystemctl() int {
	c, err := net.Dial("unix", os.Getenv(systemctlSockEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, "systemctl (tandem e2e):", err)
		return 1
	}
	defer c.Close()
	// A restart waits for a stop of up to TimeoutStopSec and a start.
	_ = c.SetDeadline(time.Now().Add(2 * time.Minute))
	var r systemctlReply
	if err := json.NewEncoder(c).Encode(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "systemctl (tandem e2e):", err)
		return 1
	}
	if err := json.NewDecoder(c).Decode(&r); err != nil {
		fmt.Fprintln(os.Stderr, "systemctl (tandem e2e):", err)
		return 1
	}
	if r.Exec != "" {
		err := syscall.Exec(r.Exec, append([]string{r.Exec}, os.Args[1:]...), os.Environ())
		fmt.Fprintln(os.Stderr, "systemctl (tandem e2e):", err)
		return 1
	}
	fmt.Fprint(os.Stdout, r.Stdout)
	fmt.Fprint(os.Stderr, r.Stderr)
	return r.Code
}

// serviceEvent is something the service manager did to the service.
type serviceEvent struct {
	verb string // the systemctl verb that did it
	stop bool   // a stop, else a start
	pid  int
	// binSum is the sha256 of the binary a start ran; clean and took
	// say how a stop went.
	binSum [32]byte
	clean  bool
	at     time.Time // of the SIGTERM or the start
	took   time.Duration
}

func (e serviceEvent) String() string {
	if e.stop {
		how := "exited"
		if !e.clean {
			how = "killed after TimeoutStopSec"
		}
		return fmt.Sprintf("systemctl %s: SIGTERM to pid %d, %s in %v", e.verb, e.pid, how, e.took.Round(time.Millisecond))
	}
	return fmt.Sprintf("systemctl %s: started pid %d (binary sha256 %x…)", e.verb, e.pid, e.binSum[:4])
}

// serviceManager runs tandem.service as installed, on host h, as g's
// process. Everything it does happens on the test's goroutine: dpkg's
// calls are handed over by serveDuring.
type serviceManager struct {
	t    *testing.T
	g    *gw
	unit map[string]string // [Service] keys, as of the last daemon-reload
	real string            // the real systemctl, "" if none
	shim string            // directory holding the systemctl shim
	sock string

	calls  []string // systemctl's arguments, one call a line
	events []serviceEvent
	// unsupported are calls it cannot answer: the test fails on them.
	unsupported []string
	// denied makes start, stop and restart do nothing, as a policy-rc.d
	// of an image build has deb-systemd-invoke do.
	denied bool
}

const unitPath = "/lib/systemd/system/tandem.service"

func newServiceManager(t *testing.T, g *gw) *serviceManager {
	t.Helper()
	dir := t.TempDir()
	sm := &serviceManager{t: t, g: g, shim: filepath.Join(dir, "bin"), sock: filepath.Join(dir, "systemctl.sock")}
	for _, p := range []string{"/usr/bin/systemctl", "/bin/systemctl"} {
		if st, err := os.Stat(p); err == nil && st.Mode()&0o111 != 0 {
			sm.real = p
			break
		}
	}
	if err := os.Mkdir(sm.shim, 0o755); err != nil {
		t.Fatal(err)
	}
	script := fmt.Sprintf("#!/bin/sh\n# systemctl of the service manager of %s\nTANDEM_E2E_HELPER=systemctl %s=%s exec %s \"$@\"\n",
		t.Name(), systemctlSockEnv, shellQuote(sm.sock), shellQuote(testBinary(t)))
	if err := os.WriteFile(filepath.Join(sm.shim, "systemctl"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sm.shim, "policy-allow"), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(unitPath); err == nil {
		sm.daemonReload()
	}
	return sm
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// daemonReload reads the installed unit's [Service] section.
func (sm *serviceManager) daemonReload() {
	sm.t.Helper()
	b, err := os.ReadFile(unitPath)
	if err != nil {
		sm.t.Fatal(err)
	}
	sm.unit = map[string]string{}
	section := ""
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[':
			section = line
		case section == "[Service]":
			k, v, _ := strings.Cut(line, "=")
			sm.unit[k] = v
		}
	}
	for _, k := range []string{"ExecStart", "User", "Group", "WorkingDirectory"} {
		if sm.unit[k] == "" {
			sm.t.Fatalf("%s has no %s=", unitPath, k)
		}
	}
}

// running is whether the service's process runs.
func (sm *serviceManager) running() bool {
	if sm.g.proc == nil {
		return false
	}
	select {
	case <-sm.g.proc.Done():
		return false
	default:
		return true
	}
}

// environment is what systemd gives the service: a plain PATH, the
// user's identity and the EnvironmentFile's assignments.
func (sm *serviceManager) environment() (map[string]string, error) {
	env := map[string]string{"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME": sm.unit["WorkingDirectory"], "USER": sm.unit["User"], "LOGNAME": sm.unit["User"]}
	f := sm.unit["EnvironmentFile"]
	if f == "" {
		return env, nil
	}
	optional := strings.HasPrefix(f, "-")
	b, err := os.ReadFile(strings.TrimPrefix(f, "-"))
	if err != nil {
		if optional && os.IsNotExist(err) {
			return env, nil
		}
		return nil, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			return nil, fmt.Errorf("%s: %q is no assignment", f, line)
		}
		if len(v) >= 2 && (v[0] == '"' || v[0] == '\'') && v[len(v)-1] == v[0] {
			v = v[1 : len(v)-1]
		}
		env[strings.TrimSpace(k)] = v
	}
	return env, nil
}

// argv is ExecStart with $VAR split on white space and ${VAR} as one
// word, as systemd expands them.
func (sm *serviceManager) argv(env map[string]string) []string {
	var argv []string
	for _, w := range strings.Fields(sm.unit["ExecStart"]) {
		switch {
		case strings.HasPrefix(w, "${") && strings.HasSuffix(w, "}"):
			argv = append(argv, env[w[2:len(w)-1]])
		case strings.HasPrefix(w, "$"):
			argv = append(argv, strings.Fields(env[w[1:]])...)
		default:
			argv = append(argv, w)
		}
	}
	return argv
}

// start runs the unit's ExecStart (Type=simple: started is all it waits
// for) as its user, in its directory, with its umask.
func (sm *serviceManager) start(verb string) error {
	if sm.running() {
		return nil
	}
	if sm.unit == nil {
		return fmt.Errorf("unit tandem.service not loaded (no daemon-reload since it was installed)")
	}
	env, err := sm.environment()
	if err != nil {
		return err
	}
	argv := sm.argv(env)
	bin, err := os.ReadFile(argv[0])
	if err != nil {
		return err
	}
	umask := sm.unit["UMask"]
	if umask == "" {
		umask = "0022"
	}
	cmd := sm.g.h.Command("sh", append([]string{"-c", `umask "$0" && u=$1 g=$2 && shift 2 && exec setpriv --reuid="$u" --regid="$g" --init-groups -- "$@"`,
		umask, sm.unit["User"], sm.unit["Group"]}, argv...)...)
	cmd.Dir = sm.unit["WorkingDirectory"]
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	p := sm.g.h.Start(cmd)
	sm.g.proc = p
	sm.events = append(sm.events, serviceEvent{verb: verb, pid: p.Cmd.Process.Pid, binSum: sha256.Sum256(bin), at: time.Now()})
	name := fmt.Sprintf("%s (tandem.service, pid %d)", sm.g.name, p.Cmd.Process.Pid)
	sm.t.Cleanup(func() {
		if sm.t.Failed() {
			sm.t.Logf("%s output:\n%s", name, p.Output())
		}
	})
	return nil
}

// stop sends SIGTERM and waits TimeoutStopSec for the exit, then kills.
func (sm *serviceManager) stop(verb string) {
	if !sm.running() {
		return
	}
	timeout := 90 * time.Second // systemd's default
	if d, err := time.ParseDuration(sm.unit["TimeoutStopSec"]); err == nil {
		timeout = d
	}
	p := sm.g.proc
	began := time.Now()
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	err := p.Wait(timeout)
	clean := err == nil
	if !clean {
		p.Stop()
	}
	sm.events = append(sm.events, serviceEvent{verb: verb, stop: true, pid: p.Cmd.Process.Pid, clean: clean, at: began, took: time.Since(began)})
}

// handle answers one systemctl call.
func (sm *serviceManager) handle(args []string) systemctlReply {
	sm.calls = append(sm.calls, strings.Join(args, " "))
	var verb, unit string
	offline := false
	for _, a := range args {
		switch {
		case strings.HasPrefix(a, "--root"):
			offline = true
		case strings.HasPrefix(a, "-"):
		case verb == "":
			verb = a
		default:
			unit = a
		}
	}
	if offline {
		return systemctlReply{Exec: sm.real}
	}
	unsupported := func() systemctlReply {
		sm.unsupported = append(sm.unsupported, strings.Join(args, " "))
		return systemctlReply{Code: 1, Stderr: "systemctl (tandem e2e): not supported here\n"}
	}
	if verb == "daemon-reload" {
		sm.daemonReload()
		return systemctlReply{}
	}
	if unit != "tandem.service" {
		return unsupported()
	}
	switch verb {
	case "is-enabled":
		// deb-systemd-helper made (or kept) the link, as systemctl would.
		if _, err := os.Lstat("/etc/systemd/system/multi-user.target.wants/tandem.service"); err == nil {
			return systemctlReply{Stdout: "enabled\n"}
		}
		return systemctlReply{Code: 1, Stdout: "disabled\n"}
	case "is-active":
		if sm.running() {
			return systemctlReply{Stdout: "active\n"}
		}
		return systemctlReply{Code: 3, Stdout: "inactive\n"}
	case "start", "stop", "restart":
		if sm.denied {
			return systemctlReply{}
		}
		if verb != "start" {
			sm.stop(verb)
		}
		if verb != "stop" {
			if err := sm.start(verb); err != nil {
				return systemctlReply{Code: 1, Stderr: fmt.Sprintf("Job for tandem.service failed: %v\n", err)}
			}
		}
		return systemctlReply{}
	}
	return unsupported()
}

// dpkg runs dpkg with args under the fake systemd (see the top of this
// file), answering its systemctl calls meanwhile, and returns its output.
func (sm *serviceManager) dpkg(allowStarts bool, args ...string) (string, error) {
	sm.t.Helper()
	ln, err := net.Listen("unix", sm.sock)
	if err != nil {
		sm.t.Fatal(err)
	}
	type request struct {
		args  []string
		reply chan systemctlReply
	}
	reqs, quit := make(chan request), make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.SetDeadline(time.Now().Add(2 * time.Minute))
			var args []string
			if json.NewDecoder(c).Decode(&args) == nil {
				r := request{args, make(chan systemctlReply, 1)}
				select {
				case reqs <- r:
					_ = json.NewEncoder(c).Encode(<-r.reply)
				case <-quit:
				}
			}
			c.Close()
		}
	}()
	// /run/systemd, or /run where there is none, gets a tmpfs of this
	// namespace only, holding system/: what the scripts take for a
	// running systemd.
	mnt := "/run/systemd"
	if st, err := os.Stat(mnt); err != nil || !st.IsDir() {
		mnt = "/run"
	}
	// deb-systemd-invoke asks policy-rc.d first; where there is one (as
	// container images install, forbidding every start with exit 101) it
	// is overlaid in that namespace too by one that allows everything,
	// as on a booted gateway, which has none. Without allowStarts the
	// service manager starts and stops nothing, as in an image build.
	policy := ""
	if _, err := os.Stat("/usr/sbin/policy-rc.d"); err == nil && allowStarts {
		policy = filepath.Join(sm.shim, "policy-allow")
	}
	sm.denied = !allowStarts
	cmd := exec.Command("unshare", append([]string{"--mount", "--propagation", "private", "sh", "-c",
		`mount -t tmpfs -o mode=0755 tandem-e2e-systemd "$0" && mkdir -p /run/systemd/system &&
		{ [ -z "$1" ] || mount --bind "$1" /usr/sbin/policy-rc.d; } && shift && exec dpkg "$@"`,
		mnt, policy}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	for _, kv := range os.Environ() {
		if k, v, _ := strings.Cut(kv, "="); k == "PATH" {
			kv = "PATH=" + sm.shim + ":" + v
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C")
	if err := cmd.Start(); err != nil {
		sm.t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	defer func() {
		close(quit)
		ln.Close()
		wg.Wait()
		os.Remove(sm.sock)
		sm.denied = false
	}()
	timeout := time.After(5 * time.Minute)
	for {
		select {
		case r := <-reqs:
			r.reply <- sm.handle(r.args)
		case err := <-waited:
			return out.String(), err
		case <-timeout:
			_ = cmd.Process.Kill()
			<-waited
			sm.t.Fatalf("dpkg %s: still running after 5 minutes:\n%s", strings.Join(args, " "), out.String())
		}
	}
}

// makeDeb runs `make cross package` for amd64 in the tree src, with
// make's variables vars, into dir, and returns the .deb.
func makeDeb(t *testing.T, src, dir string, vars ...string) string {
	t.Helper()
	args := append([]string{"-C", src, "--no-print-directory", "cross", "package",
		"BINDIR=" + filepath.Join(dir, "bin"), "DISTDIR=" + filepath.Join(dir, "dist"), "CROSS_ARCHES=amd64"}, vars...)
	cmd := exec.Command("make", args...)
	// A make running `go test` must not hand its jobserver to this one,
	// and nothing may pick the architecture for it.
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "GOARCH", "GOARM", "GOOS", "CGO_ENABLED", "GOFLAGS":
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, "GOFLAGS=-buildvcs=false")
	began := time.Now()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	debs, _ := filepath.Glob(filepath.Join(dir, "dist", "tandem_*_amd64.deb"))
	if len(debs) != 1 {
		t.Fatalf("make package in %s made %v, want one amd64 .deb", src, debs)
	}
	t.Logf("make cross package in %s: %s in %v", src, filepath.Base(debs[0]), time.Since(began).Round(time.Millisecond))
	return debs[0]
}

// releaseDeb is the previous release's amd64 .deb, built by its own
// Makefile from a worktree of its commit, and kept in
// bin/tandem_TAG-COMMIT_amd64.deb for the next run (see releaseBin).
func releaseDeb(t *testing.T) (deb, tag string) {
	t.Helper()
	tag, commit := previousRelease(t)
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	deb = filepath.Join(root, "bin", "tandem_"+tag+"-"+commit+"_amd64.deb")
	if _, err := os.Stat(deb); err == nil {
		return deb, tag
	}
	git := releaseGit(t, root, tag, commit)
	epoch, err := git("log", "-1", "--format=%ct", commit)
	if err != nil {
		t.Fatalf("git log %s: %v: %s", commit, err, epoch)
	}
	src, done := releaseWorktree(t, git, commit, "tandem-release-deb-")
	defer done()
	built := makeDeb(t, src, filepath.Join(filepath.Dir(src), "out"), "VERSION="+tag, "COMMIT="+commit[:7],
		"SOURCE_DATE_EPOCH="+strings.TrimSpace(string(epoch)))
	if err := os.MkdirAll(filepath.Dir(deb), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(built, deb); err != nil {
		t.Fatal(err)
	}
	return deb, tag
}

// debField is a control field of a .deb.
func debField(t *testing.T, deb, field string) string {
	t.Helper()
	out, err := exec.Command("dpkg-deb", "-f", deb, field).Output()
	if err != nil {
		t.Fatalf("dpkg-deb -f %s %s: %v", deb, field, err)
	}
	return strings.TrimSpace(string(out))
}

// debTree unpacks deb into a directory of the test and returns it.
func debTree(t *testing.T, deb string) string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("dpkg-deb", "-x", deb, dir).CombinedOutput(); err != nil {
		t.Fatalf("dpkg-deb -x %s: %v\n%s", deb, err, out)
	}
	return dir
}

// installedStatus is dpkg's status and version of the tandem package.
func installedStatus() string {
	out, _ := exec.Command("dpkg-query", "-W", "-f", "${db:Status-Abbrev}${Version}", "tandem").Output()
	return strings.TrimSpace(string(out))
}

// fileKey is what shows a file was kept, not replaced: inode, mode and
// owner.
type fileKey struct {
	ino      uint64
	mode     os.FileMode
	uid, gid uint32
}

func keyOf(t *testing.T, p string) fileKey {
	t.Helper()
	st, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	return fileKey{ino: sys.Ino, mode: st.Mode(), uid: sys.Uid, gid: sys.Gid}
}

// memberStatus is the part of the status JSON this test reads.
type memberStatus struct {
	Role string `json:"role"`
	Node struct {
		ID      string `json:"id"`
		Name    string `json:"name"`
		Version string `json:"version"`
	} `json:"node"`
}

// A .deb upgrade on a running member (issue 33): the previous release's
// package runs as the service of one of three members (the master, the
// others on the previous release's binary), and with QoS 1 load running
// the package of this tree is installed over it with `dpkg -i`. Its
// maintainer scripts (the old prerm and postrm, the new postinst) must
// keep the service up while the files are replaced, then restart it on
// the new binary, which rejoins: nothing acked is lost on any member,
// and the data dir and the edited configuration are kept.
func TestDebUpgradeRestartsARunningMember(t *testing.T) {
	netns.Skip(t, "dpkg", "dpkg-deb", "dpkg-query", "setpriv", "unshare", "mount", "make", "deb-systemd-invoke", "deb-systemd-helper")
	if os.Getenv("CI") != "true" {
		t.Skip("installs the tandem package on this system and upgrades it: runs with CI=true as root")
	}
	if runtime.GOARCH != "amd64" {
		t.Skipf("installs the amd64 package; this is %s", runtime.GOARCH)
	}
	// The packages are built first, alone; the rest mostly waits, and
	// runs beside the other tests that do.
	began := time.Now()
	oldDeb, tag := releaseDeb(t)
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	newDeb := makeDeb(t, root, t.TempDir())
	t.Parallel()
	testutil.SystemTest(t, "installs the tandem package on this system and upgrades it")
	if s := installedStatus(); s != "" && !strings.HasPrefix(s, "un") && !strings.HasPrefix(s, "pn") {
		t.Fatalf("the tandem package is on this system already (%s); this test would replace it", s)
	}
	for _, p := range []string{"/etc/tandem", "/var/lib/tandem", "/etc/systemd/system/multi-user.target.wants/tandem.service"} {
		if _, err := os.Lstat(p); err == nil {
			t.Fatalf("%s exists already; this test would remove it", p)
		}
	}
	_, err = user.Lookup("tandem")
	hadUser := err == nil
	t.Cleanup(func() {
		// The service's process is killed first (its cleanup is later,
		// so it runs earlier).
		exec.Command("dpkg", "--purge", "tandem").Run()
		os.RemoveAll("/etc/tandem")
		os.RemoveAll("/var/lib/tandem")
		if !hadUser {
			exec.Command("userdel", "tandem").Run()
			exec.Command("groupdel", "tandem").Run()
		}
	})
	oldVersion, newVersion := debField(t, oldDeb, "Version"), debField(t, newDeb, "Version")
	oldTree, newTree := debTree(t, oldDeb), debTree(t, newDeb)
	oldBin, newBin := filepath.Join(oldTree, "usr/bin/tandem"), filepath.Join(newTree, "usr/bin/tandem")
	newSum := sha256.Sum256(readAll(t, newBin))
	if out, err := exec.Command("dpkg", "--compare-versions", newVersion, "gt", oldVersion).CombinedOutput(); err != nil {
		t.Fatalf("this tree's package %s is not newer than %s's %s: %v %s", newVersion, tag, oldVersion, err, out)
	}

	// The previous release installed as in an image build (a policy-rc.d
	// there forbids starts), then configured as gw-3 and started.
	nt := netns.New(t, 3)
	g1, g2 := newGW(t, nt.Hosts[0], "gw-1"), newGW(t, nt.Hosts[1], "gw-2")
	g3 := newGW(t, nt.Hosts[2], "gw-3") // its config and data are the package's:
	g3.cfg, g3.dir = "/etc/tandem/tandem.yaml", "/var/lib/tandem"
	sm := newServiceManager(t, g3)
	if out, err := sm.dpkg(false, "-i", oldDeb); err != nil {
		t.Fatalf("dpkg -i %s: %v\n%s", oldDeb, err, out)
	}
	if s := installedStatus(); s != "ii "+oldVersion {
		t.Fatalf("after installing %s: %q", filepath.Base(oldDeb), s)
	}
	t.Logf("dpkg -i %s, starts forbidden: systemctl calls %q", filepath.Base(oldDeb), sm.calls)
	if sm.running() || len(sm.unsupported) > 0 {
		t.Fatalf("installing %s with starts forbidden: running %v, unsupported calls %q", filepath.Base(oldDeb), sm.running(), sm.unsupported)
	}
	edited := fmt.Sprintf(clusterConfig, g3.name, g3.dir, "", netns.Iface) + "# edited on gw-3\n"
	if err := os.WriteFile(g3.cfg, []byte(edited), 0o640); err != nil {
		t.Fatal(err)
	}
	if r := sm.handle([]string{"start", "tandem.service"}); r.Code != 0 {
		t.Fatalf("systemctl start tandem.service: %s", r.Stderr)
	}
	testutil.WaitFor(t, 15*time.Second, "gw-3 serving as tandem.service", func() bool { return g3.status() != nil })
	for _, g := range []*gw{g1, g2} {
		g.startBin(oldBin)
		g.joinBin(oldBin, g3)
	}
	waitShape(t, g3, 2, 0, 20*time.Second)
	var before memberStatus
	if !g3.statusAs(&before) || before.Node.Version != strings.TrimSuffix(oldVersion, "-1") {
		t.Fatalf("gw-3 as tandem.service of %s: status %+v", filepath.Base(oldDeb), before)
	}
	u := startUpgradeLoad(t, g1, g2, g3)
	t.Logf("gw-3 runs %s as tandem.service (%s), with gw-1 and gw-2 on its binary, under load after %v",
		filepath.Base(oldDeb), before.Role, time.Since(began).Round(time.Millisecond))

	// What must be kept.
	config := keyOf(t, g3.cfg)
	dataDir := keyOf(t, g3.dir)
	dataFiles, err := filepath.Glob(filepath.Join(g3.dir, "*"))
	if err != nil || len(dataFiles) == 0 {
		t.Fatalf("nothing in %s: %v", g3.dir, err)
	}
	oldPID := g3.proc.Cmd.Process.Pid
	sm.calls, sm.events = nil, nil

	// --force-confold, as unattended upgrades pass it: were the packaged
	// tandem.yaml changed since the previous release, dpkg would stop to
	// ask about the edited one, and there is no one to answer here.
	upgradeAt := time.Now()
	out, err := sm.dpkg(true, "-i", "--force-confdef", "--force-confold", newDeb)
	took := time.Since(upgradeAt)
	t.Logf("dpkg -i %s over %s: %v, systemctl calls:\n  %s", filepath.Base(newDeb), oldVersion, took.Round(time.Millisecond), strings.Join(sm.calls, "\n  "))
	t.Logf("dpkg's output:\n%s", out)
	if err != nil {
		t.Fatalf("dpkg -i %s: %v", newDeb, err)
	}
	if s := installedStatus(); s != "ii "+newVersion {
		t.Fatalf("after the upgrade: %q\n%s", s, out)
	}
	if len(sm.unsupported) > 0 {
		t.Errorf("the maintainer scripts made systemctl calls this test cannot answer: %q", sm.unsupported)
	}
	// One restart, after the new files were unpacked: not a stop in the
	// old prerm (the service would be down through the unpack) and not
	// left stopped, nor left running the old binary.
	if len(sm.events) != 2 || !sm.events[0].stop || sm.events[0].pid != oldPID || sm.events[1].stop ||
		sm.events[0].verb != "restart" || sm.events[1].verb != "restart" {
		t.Fatalf("the upgrade did not restart tandem.service once (pid %d before), it did: %v", oldPID, sm.events)
	}
	stop, start := sm.events[0], sm.events[1]
	if !stop.clean {
		t.Errorf("the old gw-3 (pid %d) did not stop within TimeoutStopSec of its SIGTERM", oldPID)
	}
	if start.binSum != newSum {
		t.Fatalf("the restart ran a /usr/bin/tandem that is not this tree's package's")
	}
	t.Logf("tandem.service restarted: pid %d stopped in %v, pid %d started on the new binary", oldPID, stop.took.Round(time.Millisecond), start.pid)
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", start.pid)); err != nil || exe != "/usr/bin/tandem" {
		t.Errorf("the service runs %q (%v), want /usr/bin/tandem", exe, err)
	}
	if uid := procUID(t, start.pid); uid != strconv.Itoa(int(dataDir.uid)) {
		t.Errorf("the service runs as uid %s, want tandem's (%d)", uid, dataDir.uid)
	}

	// It rejoins, on the new build, with its identity.
	masterOf(t, 20*time.Second, g1, g2, g3)
	u.sync.waitAcks(t, 20, 10*time.Second)
	u.async.waitAcks(t, 20, 10*time.Second)
	u.checkGaps(t, "gw-3 restarted by dpkg's postinst", stop.at)
	var after memberStatus
	if !g3.statusAs(&after) {
		t.Fatal("gw-3 does not answer after the upgrade")
	}
	if after.Node.Version != strings.TrimSuffix(newVersion, "-1") || after.Node.ID != before.Node.ID || after.Node.Name != before.Node.Name {
		t.Errorf("gw-3 after the upgrade: node %+v, want %s's version and the node %+v", after.Node, filepath.Base(newDeb), before.Node)
	}
	if out, err := g3.cliBin("/usr/bin/tandem", "version"); err != nil || !strings.HasPrefix(out, "tandem "+after.Node.Version+" ") {
		t.Errorf("tandem version after the upgrade: %q %v, want %s", out, err, after.Node.Version)
	}

	// The configuration and the data dir are the ones from before.
	if got := keyOf(t, g3.cfg); got != config || string(readAll(t, g3.cfg)) != edited {
		t.Errorf("the edited %s was changed: %+v, was %+v", g3.cfg, got, config)
	}
	// dpkg puts the new package's configuration beside the edited one
	// (.dpkg-dist, --force-confold) only if the two packages' differ.
	leftovers := []string{".dpkg-new", ".dpkg-old"}
	if bytes.Equal(readAll(t, filepath.Join(oldTree, g3.cfg)), readAll(t, filepath.Join(newTree, g3.cfg))) {
		leftovers = append(leftovers, ".dpkg-dist")
	}
	for _, p := range leftovers {
		if _, err := os.Lstat(g3.cfg + p); err == nil {
			t.Errorf("the upgrade left %s%s", g3.cfg, p)
		}
	}
	if got := keyOf(t, g3.dir); got != dataDir {
		t.Errorf("%s was replaced or changed: %+v, was %+v", g3.dir, got, dataDir)
	}
	for _, p := range dataFiles {
		if st, err := os.Lstat(p); err != nil {
			t.Errorf("%s is gone after the upgrade", p)
		} else if st.Sys().(*syscall.Stat_t).Uid != dataDir.uid {
			t.Errorf("%s is no longer owned by tandem", p)
		}
	}

	u.finish(t, newBin, g1, g2, g3)
	t.Logf("deb upgrade test done in %v", time.Since(began).Round(time.Millisecond))
}

func readAll(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// procUID is the real uid process pid runs as.
func procUID(t *testing.T, pid int) string {
	t.Helper()
	for _, line := range strings.Split(string(readAll(t, fmt.Sprintf("/proc/%d/status", pid))), "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] == "Uid:" {
			return f[1]
		}
	}
	return ""
}
