package e2e

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// A damage done to a stopped gateway's data file.
type damage struct {
	name string
	do   func(t *testing.T, path string)
}

// boltMetas returns the page size and the high-water mark (in pages) of
// the bbolt file at path, read off its two meta pages.
func boltMetas(t *testing.T, b []byte) (pageSize int64, pgid uint64) {
	t.Helper()
	pageSize = int64(binary.LittleEndian.Uint32(b[16+8:]))
	if pageSize < 1024 || int64(len(b)) < 2*pageSize {
		t.Fatalf("fixture: not a bbolt file (page size %d, %d bytes)", pageSize, len(b))
	}
	for _, off := range []int64{0, pageSize} {
		pgid = max(pgid, binary.LittleEndian.Uint64(b[off+16+40:]))
	}
	return pageSize, pgid
}

var damages = []damage{
	{"flipped byte in a record", func(t *testing.T, path string) {
		// Every copy of one acked payload, so that the live page is hit
		// whatever stale copies bbolt's free pages keep: in the data
		// file, or in format 6 in the WAL segment that holds it.
		flipEverywhere(t, path, []byte("load-a-heal-0-7"))
	}},
	{"truncated tail", func(t *testing.T, path string) {
		ps, pgid := boltMetas(t, readFile(t, path))
		if err := os.Truncate(path, int64(pgid)*ps-ps); err != nil {
			t.Fatal(err)
		}
	}},
	{"torn meta pages", func(t *testing.T, path string) {
		b := readFile(t, path)
		ps, _ := boltMetas(t, b)
		for _, off := range []int64{0, ps} {
			b[off+16+56] ^= 0xff // the meta page's checksum
		}
		writeFile(t, path, b)
	}},
}

// flipAll flips the last byte of every copy of pat in b and says how many
// it flipped.
func flipAll(b, pat []byte) int {
	n := 0
	for off := 0; ; n++ {
		i := bytes.Index(b[off:], pat)
		if i < 0 {
			return n
		}
		b[off+i+len(pat)-1] ^= 0x01
		off += i + len(pat)
	}
}

// flipEverywhere flips every copy of pat in the store files of the data
// file at path's dir: the data file and the WAL's.
func flipEverywhere(t *testing.T, path string, pat []byte) {
	t.Helper()
	dir := filepath.Dir(path)
	names, err := storage.Files(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, name := range names {
		p := filepath.Join(dir, name)
		b := readFile(t, p)
		if k := flipAll(b, pat); k > 0 {
			writeFile(t, p, b)
			n += k
		}
	}
	if n == 0 {
		t.Fatalf("fixture: %q not in the data file nor in the WAL", pat)
	}
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
}

// heal damages g's data file (g was stopped with before its last
// status), starts it, and waits until it has moved the damage aside and
// rejoined master's cluster as its slave under a fresh id; the damaged
// file must be kept as it was.
func heal(t *testing.T, g, master *gw, before *gwStatus, dm damage) *gwStatus {
	t.Helper()
	sum := damageAndStart(t, g, dm)
	return healed(t, g, master, before, dm, sum)
}

// damageAndStart damages the stopped g's data file and starts g; it
// returns the damaged file's hash.
func damageAndStart(t *testing.T, g *gw, dm damage) [32]byte {
	t.Helper()
	path := filepath.Join(g.dir, "tandem.db")
	dm.do(t, path)
	sum := sha256.Sum256(readFile(t, path))
	g.start()
	return sum
}

// healed waits until g, started on a data file damaged by dm (its hash
// sum), has rejoined master's cluster as its slave; see heal.
func healed(t *testing.T, g, master *gw, before *gwStatus, dm damage, sum [32]byte) *gwStatus {
	t.Helper()
	var s *gwStatus
	testutil.WaitFor(t, 20*time.Second, g.name+" re-synced after: "+dm.name, func() bool {
		s = g.status()
		return s != nil && s.Role == "slave" && s.Leader != nil && s.Leader.Name == master.name &&
			s.Storage.Damaged != nil && !s.Storage.Damaged.Resyncing
	}, func() string { b, _ := json.Marshal(s); return string(b) })
	if s.Node.ID == before.Node.ID {
		t.Errorf("%s came back under its old id %s: it lost its raft state and must rejoin as a fresh member", g.name, s.Node.ID)
	}
	kept := readFile(t, filepath.Join(s.Storage.Damaged.Dir, "tandem.db"))
	if sha256.Sum256(kept) != sum {
		t.Errorf("%s: the damaged file in %s is not the file as it was damaged", g.name, s.Storage.Damaged.Dir)
	}
	logLine(t, g, "moved aside")
	t.Logf("%s healed after %s: unreadable %v, damage %q", g.name, dm.name, s.Storage.Damaged.Unreadable, s.Storage.Damaged.Error)
	return s
}

// noneLost fails if s reports records lost.
func noneLost(t *testing.T, g *gw, s *gwStatus) {
	t.Helper()
	if len(s.Storage.Lost) != 0 {
		t.Errorf("%s: storage.lost = %v; the master held everything it had", g.name, s.Storage.Lost)
	}
}

// publishOn has clients devices publish on topic (async) to g until n
// more acks came back, and returns what was acked.
func publishOn(t *testing.T, g *gw, topic string, clients int, n int64) map[string]time.Time {
	t.Helper()
	l := startLoad(t, clients, topic, func(int) []*gw { return []*gw{g} })
	l.waitAcks(t, n, 20*time.Second)
	return l.stop()
}

// promoteOver makes g, the slave of a stopped master, the master.
func promoteOver(t *testing.T, g *gw) {
	t.Helper()
	testutil.WaitFor(t, 20*time.Second, g.name+" promoted", func() bool {
		_, err := g.cli("promote")
		return err == nil // refused until the link to the stopped master is down
	})
	waitRole(t, g, "master", "", 5*time.Second)
}

// finish waits for gws to converge, stops them (each must stop cleanly on
// SIGTERM) and checks every acked record is in every log.
func finish(t *testing.T, acked map[string]time.Time, gws ...*gw) {
	t.Helper()
	converge(t, 20*time.Second, gws...)
	for _, g := range gws {
		g.stop()
	}
	checkAll(t, acked, gws...)
}

// servesNew checks that a subscriber on the healed g receives what is
// published on master (on topic) after, each record once, and adds those
// to acked.
func servesNew(t *testing.T, g, master *gw, topic string, acked map[string]time.Time) {
	t.Helper()
	sub := subscribeOn(t, g, "sub-"+strings.ReplaceAll(topic, "/", "-"), "a/#")
	after := publishOn(t, master, topic, 1, 30)
	sub.once(t, after, 10*time.Second)
	maps.Copy(acked, after)
}

// A slave whose data file is damaged while it is stopped (a flipped byte
// in a record, a truncated tail, both meta pages torn) moves it aside,
// rejoins under a fresh id, re-syncs the whole log from the master and
// serves: a subscriber on it receives what is published after, and its
// log holds every record acked in the cluster.
func TestDamagedSlaveResyncsFromMaster(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 2)
	g1, g2 := startPair(t, nt)
	acked := publishOn(t, g1, "a/heal", 2, 100)
	for i, dm := range damages {
		converge(t, 20*time.Second, g1, g2)
		before := g2.status()
		g2.stop()
		noneLost(t, g2, heal(t, g2, g1, before, dm))
		waitShape(t, g1, 0, 1, 20*time.Second)
		servesNew(t, g2, g1, fmt.Sprintf("a/after%d", i), acked)
	}
	finish(t, acked, g1, g2)
}

// A slave found damaged at start re-syncs under a fresh id, knocking at the
// members its members.json names, where they were. The master's DHCP
// lease changed while the slave was down: the slave finds it by mDNS, by
// its id, and re-syncs there.
func TestDamagedSlaveResyncsFromAMasterThatMoved(t *testing.T) {
	// Mostly waiting (knocks at a dead address, mDNS), on a network of its
	// own: it runs beside the other waiting ones (make test's time).
	t.Parallel()
	nt := netns.New(t, 2)
	g1, g2 := startPair(t, nt)
	acked := publishOn(t, g1, "a/moved", 2, 100)
	converge(t, 20*time.Second, g1, g2)
	before := g2.status()
	g2.stop()
	nt.Hosts[0].SetAddr("101")
	noneLost(t, g2, heal(t, g2, g1, before, damages[1]))
	logLine(t, g2, "member found at a new address")
	waitShape(t, g1, 0, 1, 20*time.Second)
	servesNew(t, g2, g1, "a/after-move", acked)
	finish(t, acked, g1, g2)
}

// A master stopped and promoted over (tandem promote on its slave), whose
// data file is then found damaged, rejoins the new master as its slave the
// same way, under a fresh id.
func TestDamagedDeposedMasterResyncsAsSlave(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 2)
	g1, g2 := startPair(t, nt)
	acked := publishOn(t, g1, "a/heal", 2, 100)
	converge(t, 20*time.Second, g1, g2)
	before := g1.status()
	g1.stop()
	promoteOver(t, g2)
	maps.Copy(acked, publishOn(t, g2, "a/promoted", 1, 30))
	noneLost(t, g1, heal(t, g1, g2, before, damages[0]))
	waitShape(t, g2, 0, 1, 20*time.Second)
	servesNew(t, g1, g2, "a/after", acked)
	finish(t, acked, g2, g1)
}

// A master that acked async records alone (its slave stopped) and was
// found damaged, then promoted over (the damaged master knocking in the
// meantime): the records it can still read past the
// fork are re-published on the new master; those it cannot are reported
// by index range in the log (error level), status (storage.lost) and
// metrics (tandem_storage_lost_records_total). Nothing else is lost.
func TestDamagedMasterReportsWhatOnlyItHeld(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 2)
	g1, g2 := startPair(t, nt)
	acked := publishOn(t, g1, "a/heal", 2, 50)
	converge(t, 20*time.Second, g1, g2)
	g2.stop()
	alone := publishOn(t, g1, "a/alone", 1, 50) // async: acked on gw-1's disk alone
	before := g1.status()
	g1.stop()
	g2.start()
	pat := "load-a-alone-0-3" // 3 and 30-39: records gw-1 alone held
	lostWant := map[string]bool{}
	for p := range alone {
		if p == pat || len(p) == len(pat)+1 && p[:len(pat)] == pat {
			lostWant[p] = true
		} else {
			acked[p] = alone[p]
		}
	}
	// Damaged, gw-1 comes back while gw-2 is still a slave without a
	// master: it knocks until gw-2 is promoted, then rejoins it.
	dm := damage{"flipped bytes in records only it held", func(t *testing.T, path string) {
		flipEverywhere(t, path, []byte(pat))
	}}
	sum := damageAndStart(t, g1, dm)
	logLine(t, g1, "no master admitted this gateway yet")
	promoteOver(t, g2)
	s := healed(t, g1, g2, before, dm, sum)
	waitShape(t, g2, 0, 1, 20*time.Second)
	var lost uint64
	for _, r := range s.Storage.Lost {
		lost += r.Last - r.First + 1
	}
	if lost != uint64(len(lostWant)) {
		t.Errorf("storage.lost = %v (%d records), want the %d records whose entries were damaged", s.Storage.Lost, lost, len(lostWant))
	}
	logLine(t, g1, "level=ERROR msg=\"records this member held alone are lost")
	if m := g1.metric(t, "tandem_storage_lost_records_total"); m != float64(lost) {
		t.Errorf("tandem_storage_lost_records_total = %v, want %d", m, lost)
	}
	finish(t, acked, g2, g1)
	logged := payloads(t, g2)
	for p := range lostWant {
		if logged[p] != 0 {
			t.Errorf("%q reported lost, but gw-2 has it", p)
		}
	}
}

// metric reads one unlabelled metric from g's /metrics.
func (g *gw) metric(t *testing.T, name string) float64 {
	t.Helper()
	resp, err := g.http.Get("http://127.0.0.1:7880/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return f
		}
	}
	t.Fatalf("%s not in /metrics", name)
	return 0
}

// In a 3-gateway cluster the damaged member was a voter: the master that
// was stopped, replaced by an election, and found damaged comes back as a
// slave under a fresh id — its old id removed, the new one a learner until
// the keeper promotes it — and the cluster ends with three voters again,
// every acked record on each.
func TestDamagedVoterOfThreeResyncs(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	g1, g2, g3 := startThree(t, nt)
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	g3.join(g1)
	waitShape(t, g1, 2, 0, 15*time.Second)
	acked := publishOn(t, g1, "a/heal", 2, 100)
	converge(t, 20*time.Second, g1, g2, g3)
	before := g1.status()
	g1.stop()
	master := waitMaster(t, time.Now().Add(15*time.Second), g2, g3)
	maps.Copy(acked, publishOn(t, master, "a/elected", 1, 30))
	noneLost(t, g1, heal(t, g1, master, before, damages[0]))
	waitShape(t, master, 2, 0, 20*time.Second)
	if got := len(master.status().Members); got != 2 {
		t.Errorf("%s sees %d other members, want 2 (the old id removed)", master.name, got)
	}
	finish(t, acked, g1, g2, g3)
}
