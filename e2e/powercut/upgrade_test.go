package powercut

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	pc "github.com/tandem-edge/tandem/internal/powercut"
)

// TestPowerCutDuringTheUpgradeToFormat6 cuts the power while a build in
// data format 6 (storage's tandem_format6) upgrades, at its start, the
// data dir a release build left under load: at a seeded one of the
// upgrade's writes, syncs, renames and unlinks, or, past them, in its
// first moments of running. On what survived the build in format 6 must
// start (upgrading again if the cut came before the new data file was in
// place), hold every record the release build acked, and leave the data
// dir in format 6.
func TestPowerCutDuringTheUpgradeToFormat6(t *testing.T) {
	needFUSE(t)
	bin5, bin6 := tandemBin(t, ""), tandemBin(t, "tandem_format6")
	failed := 0
	for _, seed := range seeds(t, 8) {
		o, err := upgradeRound(bin5, bin6, t.TempDir(), seed)
		if err != nil {
			t.Fatalf("seed %d: %v (replay: POWERCUT_SEED=%d)", seed, err, seed)
		}
		if len(o.violations) > 0 {
			failed++
			t.Errorf("round %s\n  %s\n  replay: POWERCUT_SEED=%d go test ./e2e/powercut/ -run TestPowerCutDuringTheUpgradeToFormat6", o, strings.Join(o.violations, "\n  "), seed)
			continue
		}
		if testing.Verbose() {
			t.Logf("round %s: ok (%s)", o, strings.Join(o.phases, ", "))
		}
	}
	if failed > 0 {
		t.Logf("%d rounds failed", failed)
	}
}

// upgradeTargets are where a round aims its cut, each a kind of the
// upgrade's operations and how many of them it may skip: a segment's
// write or sync, the new data file's (up to its rename over the old one),
// a name made, renamed or removed or a directory synced. A fourth kind of
// round cuts once the gateway is up, past the upgrade.
var upgradeTargets = []struct {
	name string
	op   func(pc.Op) bool
	skip int
}{
	{"segments", func(op pc.Op) bool {
		n, ok := strings.CutPrefix(op.Path, "tandem.wal.")
		_, err := strconv.Atoi(n)
		return ok && err == nil && n != "0" && n != "1"
	}, 60},
	{"new data file", func(op pc.Op) bool { return strings.HasPrefix(op.Path, "tandem.db.upgrade") }, 12},
	{"names", func(op pc.Op) bool { return op.Kind == pc.Create || op.Kind == pc.DirSync }, 12},
}

// upgradeRound runs one round: the release build under load on the
// power-cut filesystem, stopped (cleanly or killed, by the seed), then the
// format 6 build started on it with the cut armed, then that build again
// on what survived.
func upgradeRound(bin5, bin6, base string, seed uint64) (*outcome, error) {
	rng := rand.New(rand.NewPCG(seed, 0x7570677264))
	o := &outcome{seed: seed, kind: upgrade, tear: rng.IntN(2) == 0}
	fs, backing, mnt, err := mountRound(base, seed)
	if err != nil {
		return nil, err
	}
	defer fs.Unmount()
	t0 := time.Now()
	g, err := startGateway(bin5, base, mnt, "always", "")
	if err != nil {
		return nil, fmt.Errorf("release build: %w", err)
	}
	defer g.kill()
	clients := []*client{
		{id: "c311q1", qos: 1}, {id: "c311q2", qos: 2},
		{id: "c5q1", v5: true, qos: 1}, {id: "c5q2", v5: true, qos: 2},
	}
	stop, wait := runClients(clients, g.mqtt)
	time.Sleep(time.Duration(300+rng.IntN(700)) * time.Millisecond) // the seeded load: it runs meanwhile
	stop()
	wait()
	if rng.IntN(2) == 0 {
		g.kill() // its WAL's last frames not checkpointed
	} else if err := g.stop(10 * time.Second); err != nil {
		o.violations = append(o.violations, "the release build: "+err.Error())
	}
	o.phase("load", &t0)

	if aim := rng.IntN(len(upgradeTargets) + 1); aim < len(upgradeTargets) {
		target, skip, n := upgradeTargets[aim], rng.IntN(upgradeTargets[aim].skip), 0
		o.aim = fmt.Sprintf("%s, past %d", target.name, skip)
		fs.CutWhen(func(op pc.Op) bool {
			if !target.op(op) {
				return false
			}
			n++
			return n > skip
		}, o.tear)
	} else {
		o.aim = "once up"
	}
	cfg := filepath.Join(base, "tandem.yaml") // startGateway's, from the release build's start
	mq, err1 := freeAddr()
	ht, err2 := freeAddr()
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("addresses: %v %v", err1, err2)
	}
	g2, err := launch(bin6, cfg, mnt, mq, ht, "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	defer g2.kill()
	ready := make(chan error, 1)
	go func() { ready <- g2.waitReady(20 * time.Second) }()
	select {
	case <-fs.Done():
		g2.kill()
		<-ready // it returns once the gateway exited
	case <-ready:
		fs.Cut(o.tear) // past the upgrade: its first moments in format 6
		g2.kill()
	}
	o.cut = *fs.Report()
	o.phase("upgrade", &t0)
	if err := fs.Unmount(); err != nil {
		return nil, fmt.Errorf("unmount: %v", err)
	}

	g3, err := startGateway(bin6, base, backing, "always", "")
	if err != nil {
		o.violations = append(o.violations, fmt.Sprintf("the format 6 build refused to start on what survived: %v", err))
		return o, nil
	}
	defer g3.kill()
	if err := probe(g3.mqtt); err != nil {
		o.violations = append(o.violations, fmt.Sprintf("the restarted gateway acks no publish: %v", err))
	}
	if err := g3.stop(5 * time.Second); err != nil {
		o.violations = append(o.violations, "the restarted gateway: "+err.Error())
	}
	o.phase("restart", &t0)
	if err := format6Dir(backing); err != nil {
		o.violations = append(o.violations, "data dir: "+err.Error())
	}
	seqs, err := inspect(bin6, backing)
	if err != nil {
		o.violations = append(o.violations, err.Error())
		return o, nil
	}
	for _, c := range clients {
		o.check(c, seqs[c.id], time.Now(), time.Time{})
	}
	o.phase("inspect", &t0)
	return o, nil
}

// format6Dir says what in dir is not a data dir of format 6: format 5's
// WAL files, an upgrade's leftovers, no segment.
func format6Dir(dir string) error {
	des, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	segs := 0
	for _, de := range des {
		if de.Name() == "tandem.db.upgrade" {
			return fmt.Errorf("%s left in the data dir", de.Name())
		}
		n, ok := strings.CutPrefix(de.Name(), "tandem.wal.")
		if !ok {
			continue
		}
		if k, err := strconv.Atoi(n); err == nil && k < 2 {
			return fmt.Errorf("%s in the data dir: format 5's WAL, not format 6's segments", de.Name())
		}
		segs++
	}
	if segs == 0 {
		return fmt.Errorf("no WAL segment in the data dir")
	}
	return nil
}
