package daemon_test

// `tandem repair` on a lone gateway's damaged data dir, with the real
// binary: each damage a medium or a power cut gives, then repair, then the
// gateway started on the result.

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	paho "github.com/eclipse/paho.mqtt.golang"

	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// repairRecords records of some 200 bytes: several checkpoints' worth, so
// that most of the log is in the data file and the newest part in the WAL.
const repairRecords = 3000

// repairPayload is record i's payload: unique, so that the test finds its
// bytes in the data file.
func repairPayload(i int) string {
	return fmt.Sprintf("repair-%05d-%s", i, strings.Repeat("x", 180))
}

// fillGateway runs a gateway on dir, publishes repairRecords QoS 1 records
// and a retained one, stops it and returns its log by index.
func fillGateway(t *testing.T, dir string) map[uint64]string {
	t.Helper()
	p := startTandem(t, dir, nil)
	c := mqttConnect(t, p.addrs.mqtt, "repair-pub")
	toks := make([]paho.Token, repairRecords)
	for i := range repairRecords {
		toks[i] = c.Publish("repair/data", 1, false, repairPayload(i))
	}
	for i, tk := range toks {
		if !tk.WaitTimeout(10*time.Second) || tk.Error() != nil {
			t.Fatalf("publish %d: %v", i, tk.Error())
		}
	}
	if tk := c.Publish("repair/kept", 1, true, "retained-before"); !tk.WaitTimeout(10*time.Second) || tk.Error() != nil {
		t.Fatalf("retained publish: %v", tk.Error())
	}
	c.Disconnect(100)
	if code := p.stop(10 * time.Second); code != 0 {
		t.Fatalf("gateway exit code %d on SIGTERM", code)
	}
	return logByIndex(t, dir)
}

func sumFile(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

func mqttConnect(t *testing.T, addr, id string) paho.Client {
	t.Helper()
	c := paho.NewClient(paho.NewClientOptions().AddBroker("tcp://" + addr).SetClientID(id).
		SetAutoReconnect(false).SetConnectRetry(false).SetConnectTimeout(5 * time.Second))
	if tk := c.Connect(); !tk.WaitTimeout(10*time.Second) || tk.Error() != nil {
		t.Fatalf("connect %s: %v", id, tk.Error())
	}
	return c
}

func logByIndex(t *testing.T, dir string) map[uint64]string {
	t.Helper()
	out := map[uint64]string{}
	for _, r := range runInspect(t, dir) {
		out[r.Index] = string(r.payload)
	}
	return out
}

// runTandemCmd runs the binary with args and returns its exit code and
// output.
func runTandemCmd(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(tandemBinary(t), args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatalf("tandem %v: %v", args, err)
	}
	return cmd.ProcessState.ExitCode(), stdout.String(), stderr.String()
}

// indexOf returns the index of the record with payload p.
func indexOf(t *testing.T, log map[uint64]string, p string) uint64 {
	t.Helper()
	for i, v := range log {
		if v == p {
			return i
		}
	}
	t.Fatalf("no record %q in the log", p[:12])
	return 0
}

// flipRecord flips a byte of record i's payload in every copy the data file
// holds of it (stale pages may hold one too).
func flipRecord(t *testing.T, dir string, i int) {
	t.Helper()
	path := filepath.Join(dir, storage.FileName)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	pat := []byte(repairPayload(i))
	n := 0
	for off := 0; ; {
		j := bytes.Index(b[off:], pat)
		if j < 0 {
			break
		}
		b[off+j+20] ^= 0x40
		off += j + len(pat)
		n++
	}
	if n == 0 {
		t.Fatalf("fixture: record %d not found in %s", i, path)
	}
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
}

// metaPages returns the page size and, per meta page, its txid (-1 when
// it does not check out).
func metaPages(t *testing.T, path string) (int64, [2]int64) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ps := int64(binary.LittleEndian.Uint32(b[16+8:]))
	var tx [2]int64
	for i := range 2 {
		m := b[int64(i)*ps+16:][:64]
		h := fnv.New64a()
		h.Write(m[:56])
		tx[i] = -1
		if binary.LittleEndian.Uint32(m) == 0xED0CDAED && h.Sum64() == binary.LittleEndian.Uint64(m[56:]) {
			tx[i] = int64(binary.LittleEndian.Uint64(m[48:]))
		}
	}
	return ps, tx
}

// damageCase is one way a data dir gets damaged.
type damageCase struct {
	name string
	// damage damages dir and returns the index of the first record it
	// can have lost (every record before it must survive), or 0 when
	// nothing should be lost.
	damage func(t *testing.T, dir string, log map[uint64]string) uint64
	// refused says whether a start refuses the damaged dir.
	refused bool
}

func TestRepairDamagedLoneGateway(t *testing.T) {
	cases := []damageCase{
		{"flipped byte in a record", func(t *testing.T, dir string, log map[uint64]string) uint64 {
			flipRecord(t, dir, 250)
			return indexOf(t, log, repairPayload(250))
		}, true},
		{"torn meta page", func(t *testing.T, dir string, _ map[uint64]string) uint64 {
			// The newest meta page torn (its checksum no longer matches),
			// as a power cut during the last commit leaves it.
			path := filepath.Join(dir, storage.FileName)
			ps, tx := metaPages(t, path)
			newest := int64(0)
			if tx[1] > tx[0] {
				newest = 1
			}
			f, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt(make([]byte, 40), newest*ps+16+32); err != nil {
				t.Fatal(err)
			}
			f.Close()
			if _, after := metaPages(t, path); after[newest] != -1 || after[1-newest] < 0 {
				t.Fatalf("fixture: meta pages %v after tearing page %d (before %v)", after, newest, tx)
			}
			return 0
		}, false},
		{"truncated tail of the data file", func(t *testing.T, dir string, log map[uint64]string) uint64 {
			path := filepath.Join(dir, storage.FileName)
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			// Cut the file just before the last page holding the newest
			// record: everything from there on is gone.
			last := bytes.LastIndex(b, []byte(repairPayload(repairRecords-1)))
			ps, _ := metaPages(t, path)
			if err := os.Truncate(path, int64(last)/ps*ps); err != nil {
				t.Fatal(err)
			}
			return 1 // what survives depends on bbolt's pages: checked below
		}, true},
	}
	cases = append(cases, damageCase{"truncated to two thirds", func(t *testing.T, dir string, log map[uint64]string) uint64 {
		path := filepath.Join(dir, storage.FileName)
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		ps, _ := metaPages(t, path)
		if err := os.Truncate(path, st.Size()*2/3/ps*ps); err != nil {
			t.Fatal(err)
		}
		return 1
	}, true})
	cases = append(cases, damageCase{"both meta pages torn", func(t *testing.T, dir string, _ map[uint64]string) uint64 {
		// Not what one power cut does (bbolt writes one meta page per
		// commit), but what a medium that loses its first pages does:
		// bbolt cannot open the file at all, start refuses, and repair
		// reads it page by page.
		path := filepath.Join(dir, storage.FileName)
		ps, _ := metaPages(t, path)
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for i := range int64(2) {
			if _, err := f.WriteAt(make([]byte, 40), i*ps+16+32); err != nil {
				t.Fatal(err)
			}
		}
		return 0
	}, true})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			before := fillGateway(t, dir)
			if len(before) < repairRecords {
				t.Fatalf("fixture: %d records in the log, published %d", len(before), repairRecords)
			}
			from := tc.damage(t, dir, before)
			damaged := sumFile(t, filepath.Join(dir, storage.FileName))

			// What a start says of the damaged dir today.
			// (On a copy: a start that works rewrites the file.)
			refused, out := startOrRefuse(t, copyDir(t, dir))
			if refused != tc.refused || (refused && !strings.Contains(out, "corrupt")) {
				t.Fatalf("start on the damaged dir: refused=%v, want %v; output:\n%s", refused, tc.refused, out)
			}
			args := []string{"repair", "--data", dir}
			if !tc.refused {
				// bbolt falls back past a torn meta page and the WAL
				// replays the rest: the dir passes its checks, and
				// repair says so and changes nothing...
				code, stdout, stderr := runTandemCmd(t, args...)
				if code != 0 || !strings.Contains(stdout, "nothing to repair") {
					t.Errorf("repair of a dir that passes its checks: exit %d\n%s%s", code, stdout, stderr)
				}
				if sumFile(t, filepath.Join(dir, storage.FileName)) != damaged {
					t.Fatal("repair changed a data file that passes its checks")
				}
				// ...unless forced, when it copies it through the older
				// meta page, losing nothing.
				args = append(args, "--force")
			}
			code, stdout, stderr := runTandemCmd(t, args...)
			t.Logf("tandem %s:\n%s%s", strings.Join(args, " "), stdout, stderr)
			if code != 0 {
				t.Fatalf("tandem repair: exit %d\n%s%s", code, stdout, stderr)
			}
			// The original, byte for byte, in the folder repair names.
			m := regexp.MustCompile(`kept, unchanged, in (\S+)\.`).FindStringSubmatch(stdout)
			if m == nil {
				t.Fatalf("repair does not say where the damaged files are:\n%s", stdout)
			}
			if got := sumFile(t, filepath.Join(m[1], storage.FileName)); got != damaged {
				t.Errorf("the kept data file differs from the damaged one")
			}

			p := startTandem(t, dir, nil)
			// The broker state: the retained message is still there.
			sub := mqttConnect(t, p.addrs.mqtt, "repair-sub")
			got := make(chan string, 4)
			if tk := sub.Subscribe("repair/kept", 1, func(_ paho.Client, m paho.Message) { got <- string(m.Payload()) }); !tk.WaitTimeout(10*time.Second) || tk.Error() != nil {
				t.Fatalf("subscribe: %v", tk.Error())
			}
			select {
			case m := <-got:
				if m != "retained-before" {
					t.Errorf("retained message after the repair: %q", m)
				}
			case <-time.After(10 * time.Second):
				t.Error("the retained message is gone after the repair")
			}
			sub.Disconnect(100)
			publishAndStop(t, p, "after-repair")
			after := logByIndex(t, dir)
			lost := lostIndexes(t, stdout)
			for i, want := range before {
				got, ok := after[i]
				switch {
				case ok && got != want:
					t.Errorf("index %d: payload %.14q after repair, %.14q before", i, got, want)
				case !ok && !lost[i]:
					t.Errorf("index %d (%.14q) is gone, and repair's output does not name it lost", i, want)
				case !ok && i < from:
					t.Errorf("index %d (%.14q), before the damage, is gone", i, want)
				}
			}
			switch {
			case from > 1 && (len(lost) != 1 || !lost[from]):
				t.Errorf("repair reports lost indexes %v, want exactly the damaged record's, %d", lost, from)
			case from == 0 && (len(lost) != 0 || !strings.Contains(stdout, "Lost records: none")):
				t.Errorf("repair reports lost indexes %v, want none", lost)
			case tc.name == "truncated to two thirds" && len(lost) == 0 && !strings.Contains(stdout, "the commit before it was read instead") && !strings.Contains(stdout, "read page by page"):
				// A third of the pages gone: unless the commit before
				// the newest still had all its pages, or the log's leaf
				// pages all survived and were read one by one (with the
				// WAL for the rest; every index is checked above),
				// records on them are lost, and named.
				t.Errorf("repair names no lost index after a third of the data file was cut off, and read no older commit:\n%s", stdout)
			}
			var lastBefore uint64
			for i := range before {
				lastBefore = max(lastBefore, i)
			}
			if i := indexOf(t, after, "after-repair"); i <= lastBefore {
				t.Errorf("the record published after the repair is at index %d, inside the old log (1 to %d)", i, lastBefore)
			}
		})
	}
}

// copyDir copies the data dir's files into a new temp dir.
func copyDir(t *testing.T, dir string) string {
	t.Helper()
	dst := t.TempDir()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dst
}

// publishAndStop checks that the gateway p takes a publish (payload
// payload), then that it stops on SIGTERM within seconds.
func publishAndStop(t *testing.T, p *tandemProc, payload string) {
	t.Helper()
	c := mqttConnect(t, p.addrs.mqtt, "pub-"+payload)
	if tk := c.Publish("repair/data", 1, false, payload); !tk.WaitTimeout(10*time.Second) || tk.Error() != nil {
		t.Fatalf("publish %q: %v", payload, tk.Error())
	}
	c.Disconnect(100)
	if code := p.stop(10 * time.Second); code != 0 {
		t.Errorf("gateway exit %d on SIGTERM", code)
	}
}

// startOrRefuse runs `tandem run` on dir: refused when it exits before it
// serves; otherwise it is stopped with SIGTERM.
func startOrRefuse(t *testing.T, dir string) (bool, string) {
	t.Helper()
	http := testutil.FreeAddr(t)
	cmd := exec.Command(tandemBinary(t), "run", "--data", dir, "--mqtt", "127.0.0.1:0", "--http", http, "--peer", "127.0.0.1:0")
	out := &testutil.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &tandemProc{t: t, dataDir: dir, addrs: tandemAddrs{http: http}, cmd: cmd, out: out, exited: make(chan struct{})}
	go func() { p.waitErr = cmd.Wait(); close(p.exited) }()
	defer p.kill9()
	if err := p.waitReady(readyTimeout); err != nil {
		return true, out.String()
	}
	if code := p.stop(10 * time.Second); code != 0 {
		t.Errorf("exit %d on SIGTERM", code)
	}
	return false, out.String()
}

// lostIndexes reads repair's "LOST: index A to B" lines.
func lostIndexes(t *testing.T, out string) map[uint64]bool {
	t.Helper()
	lost := map[uint64]bool{}
	for _, m := range regexp.MustCompile(`LOST: index (\d+)(?: to (\d+))?`).FindAllStringSubmatch(out, -1) {
		a, _ := strconv.ParseUint(m[1], 10, 64)
		b := a
		if m[2] != "" {
			b, _ = strconv.ParseUint(m[2], 10, 64)
		}
		for i := a; i <= b; i++ {
			lost[i] = true
		}
	}
	return lost
}

// repair never touches a running gateway's data dir: it says so, and
// the gateway goes on serving.
func TestRepairRefusesARunningGateway(t *testing.T) {
	dir := t.TempDir()
	p := startTandem(t, dir, nil)
	names := func() []string {
		ents, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range ents {
			out = append(out, e.Name())
		}
		return out
	}
	before := names()
	for _, args := range [][]string{{"repair", "--data", dir}, {"repair", "--data", dir, "--force"}} {
		code, stdout, stderr := runTandemCmd(t, args...)
		if code != 1 || !strings.Contains(stderr, "in use") || !strings.Contains(stderr, "stop the gateway first") {
			t.Errorf("tandem %s on a running gateway: exit %d, want 1 and \"in use\"\nstdout:\n%sstderr:\n%s", strings.Join(args, " "), code, stdout, stderr)
		}
	}
	if got := names(); strings.Join(got, " ") != strings.Join(before, " ") {
		t.Errorf("data dir holds %v after the refused repair, %v before", got, before)
	}
	publishAndStop(t, p, "still-serving")
	// Stopped and healthy: nothing to repair, nothing changed.
	code, stdout, _ := runTandemCmd(t, "repair", "--data", dir)
	if code != 0 || !strings.Contains(stdout, "nothing to repair") {
		t.Errorf("repair of a healthy stopped gateway: exit %d\n%s", code, stdout)
	}
	if got := names(); strings.Join(got, " ") != strings.Join(before, " ") {
		t.Errorf("data dir holds %v after repairing a healthy dir, %v before", got, before)
	}
}
