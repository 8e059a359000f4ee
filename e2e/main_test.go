// Package e2e holds tests that run real tandem processes on real networks:
// network-namespace hosts from internal/netns, real mDNS between them.
// They need root and iproute2 and skip without them (fail under CI=true).
//
// Every test calls t.Parallel, after the builds it needs (tests run one at
// a time until then): namespace names carry the pid and a counter, and
// the bridge, the veths and the 198.51.100.0/24 addresses live inside a
// test's own namespaces, so nothing collides. A test that changes
// process-wide state (the environment, a fixed port of the machine's own
// namespace) must not. The hostile-device suite stays serial: it floods
// its gateways as fast as the cores allow, and make test runs it alone.
package e2e

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/discovery"
)

// binDir holds the tandem binary TestMain's first caller of tandemBin
// builds; removed when the tests end.
var (
	binDir string
	// buildMu guards builtBin, buildErr and otherBuilt, and serialises
	// every go build the tests run: two at once would only fight over
	// the cores while the tests beside them wait on timers.
	buildMu  sync.Mutex
	builtBin string
	buildErr error
)

// defaultParallel is how many tests run at once unless -test.parallel
// says otherwise. Each test has network namespaces of its own and mostly
// waits on timeouts and elections, so more of them than cores fit.
const defaultParallel = 4

// TestMain also serves as the helper process the tests start inside a
// namespace: with TANDEM_E2E_HELPER set, the test binary runs that helper
// instead of the tests (see runHelper). It runs defaultParallel tests at
// once unless -test.parallel (go test -parallel) is given.
func TestMain(m *testing.M) {
	if h := os.Getenv("TANDEM_E2E_HELPER"); h != "" {
		os.Exit(runHelper(h))
	}
	dir, err := os.MkdirTemp("", "tandem-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	flag.Parse()
	explicit := false
	flag.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "test.parallel" })
	if !explicit {
		if err := flag.Set("test.parallel", strconv.Itoa(defaultParallel)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// tandemBin builds bin/tandem from this module once per test binary
// (`go build -o TMP/tandem .`) and returns its path. TANDEM_E2E_TAGS, if
// set, are build tags for it: the suite against a test build, such as
// storage's tandem_format6 before that format is the default.
func tandemBin(t testing.TB) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if builtBin == "" && buildErr == nil {
		out := filepath.Join(binDir, "tandem")
		args := []string{"build", "-o", out}
		if tags := os.Getenv("TANDEM_E2E_TAGS"); tags != "" {
			args = append(args, "-tags", tags)
		}
		cmd := exec.Command("go", append(args, ".")...)
		cmd.Dir = ".."
		if b, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, b)
		} else {
			builtBin = out
		}
	}
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return builtBin
}

// testBinary is this test binary's path, to run as a helper inside a
// namespace (/proc/self/exe would name `ip` there).
func testBinary(t testing.TB) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

// runHelper runs the helper named by TANDEM_E2E_HELPER:
//
//	advertise: discovery.Advertise with the discovery.Info JSON in
//	TANDEM_E2E_INFO on TANDEM_E2E_IFACE. Prints "ready BACKEND". Each
//	line of Info JSON on stdin replaces the info and calls Changed, then
//	prints "changed"; EOF closes the advertiser and exits 0.
//
//	systemctl: systemctl for the service manager of a test whose unix
//	socket TANDEM_E2E_SYSTEMCTL names (fakeSystemctl).
func runHelper(name string) int {
	switch name {
	case "advertise":
		var mu sync.Mutex
		var info discovery.Info
		if err := json.Unmarshal([]byte(os.Getenv("TANDEM_E2E_INFO")), &info); err != nil {
			fmt.Println("error", err)
			return 1
		}
		a, err := discovery.Advertise(discovery.Config{
			Interface: os.Getenv("TANDEM_E2E_IFACE"),
			Info: func() discovery.Info {
				mu.Lock()
				defer mu.Unlock()
				return info
			},
		})
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		fmt.Println("ready", a.Backend())
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			var next discovery.Info
			if err := json.Unmarshal([]byte(strings.TrimSpace(sc.Text())), &next); err != nil {
				fmt.Println("error", err)
				continue
			}
			mu.Lock()
			info = next
			mu.Unlock()
			a.Changed()
			fmt.Println("changed")
		}
		if err := a.Close(); err != nil {
			fmt.Println("error", err)
			return 1
		}
		return 0
	case "systemctl":
		// The service manager's systemctl (debupgrade_test.go).
		return fakeSystemctl()
	}
	fmt.Println("unknown helper", name)
	return 2
}

// testSeed is a seeded test's seed: env's value when set (a replay), the
// clock's otherwise. The test prints it with env's name, so that a
// failure replays.
func testSeed(t *testing.T, env string) uint64 {
	t.Helper()
	s := os.Getenv(env)
	if s == "" {
		return uint64(time.Now().UnixNano())
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatalf("%s=%q: %v", env, s, err)
	}
	return v
}
