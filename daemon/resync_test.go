package daemon

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/cluster"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// tearMetaPages damages both meta pages of the data file in dir: bbolt
// then opens neither commit.
func tearMetaPages(t *testing.T, dir string) [32]byte {
	t.Helper()
	path := filepath.Join(dir, storage.FileName)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ps := int(binary.LittleEndian.Uint32(b[16+8:]))
	for _, off := range []int{0, ps} {
		b[off+16+56] ^= 0xff // the meta page's checksum
	}
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// startErr starts a gateway on dir and returns its Start error; a gateway
// that starts is stopped again.
func startErr(t *testing.T, dir string, mutate func(*config.Config)) error {
	t.Helper()
	cfg := config.DefaultConfig()
	cfg.Node.DataDir = dir
	cfg.MQTT.Listen, cfg.HTTP.Listen, cfg.Peer.Listen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	if mutate != nil {
		mutate(cfg)
	}
	d, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	err = d.Start(ctx)
	if err == nil {
		d.Stop()
	}
	return err
}

// refusedAsIs fails unless starting on dir is refused as corrupt with the
// data dir exactly as it was: the data file unchanged, nothing moved.
func refusedAsIs(t *testing.T, dir string, sum [32]byte, mutate func(*config.Config)) {
	t.Helper()
	names := func() []string {
		es, _ := os.ReadDir(dir)
		var out []string
		for _, e := range es {
			out = append(out, e.Name())
		}
		return out
	}
	before := names()
	if err := startErr(t, dir, mutate); !errors.Is(err, storage.ErrCorrupt) {
		t.Fatalf("start on a damaged data file: %v, want a refusal wrapping ErrCorrupt", err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, storage.FileName))
	if sha256.Sum256(b) != sum {
		t.Error("the refused data file was changed")
	}
	if after := names(); len(after) != len(before) {
		t.Errorf("data dir holds %v after the refusal, %v before", after, before)
	}
	if _, err := os.Stat(filepath.Join(dir, damagedDirName)); err == nil {
		t.Error("a refusal made a damaged/ dir")
	}
}

// A lone gateway has nobody to heal from: even with on_damage resync (the
// default) it refuses a damaged data file as it always did.
func TestDamagedLoneGatewayRefuses(t *testing.T) {
	dir := t.TempDir()
	testGateway(t, dir, nil).Stop()
	refusedAsIs(t, dir, tearMetaPages(t, dir), nil)
}

// A cluster member heals in process as between hosts (e2e/heal_test.go):
// with on_damage refuse it refuses; with resync it moves the damage aside,
// rejoins under a fresh id and takes the master's log, which it then
// delivers to its subscribers.
func TestDamagedMemberRefusesOrResyncs(t *testing.T) {
	p1, g2 := inProcessPair(t, nil)
	g1 := p1.d
	pub, _ := v5(t, g1.MQTTAddr(), "pub", nil)
	for i := range 20 {
		publish(t, pub, &paho.Publish{Topic: "a/before", QoS: 1, Payload: []byte{byte(i)}})
	}
	testutil.WaitFor(t, 5*time.Second, "gw-2 holding the records", func() bool { return topicsIn(t, g2.d)["a/before"] == 20 })
	oldID := g2.d.id.ID
	g2.d.Stop()
	sum := tearMetaPages(t, g2.dir)

	refuse := func(c *config.Config) {
		clusterTestConfig(c, "gw-2")
		c.Storage.OnDamage = "refuse"
	}
	refusedAsIs(t, g2.dir, sum, refuse)

	g2.start(t, nil)
	testutil.WaitFor(t, 15*time.Second, "gw-2 re-synced as gw-1's slave", func() bool {
		s := statusOfGW(t, g2.d)
		return s.Role == "slave" && s.Storage.Damaged != nil && !s.Storage.Damaged.Resyncing && topicsIn(t, g2.d)["a/before"] == 20
	})
	if g2.d.id.ID == oldID {
		t.Error("gw-2 came back under its old id")
	}
	s := statusOfGW(t, g2.d)
	kept, err := os.ReadFile(filepath.Join(s.Storage.Damaged.Dir, storage.FileName))
	if err != nil || sha256.Sum256(kept) != sum {
		t.Errorf("the damaged file is not kept as it was in %s (%v)", s.Storage.Damaged.Dir, err)
	}
	if len(s.Storage.Lost) != 0 || s.Storage.Damaged.Opened {
		t.Errorf("storage = %+v, want nothing lost and the damaged file unread", s.Storage)
	}
	for _, m := range statusOfGW(t, g1).Members {
		if m.ID == replication.IDString(oldID) {
			t.Errorf("gw-1 still has gw-2's old id %s as a member", m.ID)
		}
	}
	sub, got := v5(t, g2.d.MQTTAddr(), "sub", nil)
	subscribe(t, sub, "a/#", 1)
	publish(t, pub, &paho.Publish{Topic: "a/after", QoS: 1, Payload: []byte("after")})
	select {
	case p := <-got:
		if string(p.Payload) != "after" {
			t.Errorf("subscriber on gw-2 got %q", p.Payload)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a subscriber on the re-synced gw-2 got nothing")
	}
	g2.d.Stop()
	// Restarted, it is the slave it became, the record of the damage kept.
	g2.start(t, nil)
	testutil.WaitFor(t, 10*time.Second, "gw-2 a slave again after a restart", func() bool {
		s := statusOfGW(t, g2.d)
		return s.Role == "slave" && s.Storage.Damaged != nil && !s.Storage.Damaged.Resyncing
	})
}

// A re-sync interrupted before the master took the gateway back (the
// master down, then the gateway restarted) goes on at the next start,
// still proven by the old identity kept with the damaged files: it does not
// start as a new lone gateway on the fresh data file.
func TestInterruptedResyncGoesOn(t *testing.T) {
	g1, g2 := inProcessPair(t, nil)
	g2.d.Stop()
	g1.d.Stop()
	tearMetaPages(t, g2.dir)

	g2.start(t, nil) // no master to take it back
	if s := statusOfGW(t, g2.d); s.Storage.Damaged == nil || !s.Storage.Damaged.Resyncing || len(s.Members) != 0 {
		t.Fatalf("gw-2 with its master down: storage %+v, members %+v; want a re-sync under way", s.Storage, s.Members)
	}
	fresh := g2.d.id.ID
	g2.d.Stop()
	if _, err := os.Stat(filepath.Join(g2.dir, resyncFile)); err != nil {
		t.Fatalf("the re-sync record is gone before the re-sync was done: %v", err)
	}

	g1.start(t, nil)
	g2.start(t, nil)
	if g2.d.id.ID != fresh {
		t.Errorf("gw-2 restarted under id %x, want the fresh one %x", g2.d.id.ID, fresh)
	}
	testutil.WaitFor(t, 15*time.Second, "gw-2 re-synced as gw-1's slave", func() bool {
		s := statusOfGW(t, g2.d)
		return s.Role == "slave" && s.Storage.Damaged != nil && !s.Storage.Damaged.Resyncing
	})
	if _, err := os.Stat(filepath.Join(g2.dir, resyncFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the re-sync record is still there once done: %v", err)
	}
}

// A crash after the re-sync was recorded but before the damaged files were
// all moved aside: the next start finishes the move (the key last, so the
// key left in the data dir is still the old one) and heals.
func TestResyncFinishesAnInterruptedMove(t *testing.T) {
	_, g2 := inProcessPair(t, nil)
	oldID := g2.d.id.ID
	g2.d.Stop()
	sum := tearMetaPages(t, g2.dir)
	known, err := cluster.ReadMembersFile(g2.dir)
	if err != nil {
		t.Fatal(err)
	}
	dest := filepath.Join(g2.dir, damagedDirName, "crashed")
	b, _ := json.Marshal(resyncState{Dir: dest, At: time.Now(), Error: "torn meta pages", Known: known})
	if err := os.WriteFile(filepath.Join(g2.dir, resyncFile), b, 0o640); err != nil {
		t.Fatal(err)
	}
	g2.start(t, nil)
	testutil.WaitFor(t, 15*time.Second, "gw-2 re-synced as gw-1's slave", func() bool {
		s := statusOfGW(t, g2.d)
		return s.Role == "slave" && s.Storage.Damaged != nil && !s.Storage.Damaged.Resyncing
	})
	if g2.d.id.ID == oldID {
		t.Error("gw-2 came back under its old id")
	}
	kept, err := os.ReadFile(filepath.Join(dest, storage.FileName))
	if err != nil || sha256.Sum256(kept) != sum {
		t.Errorf("the damaged file is not in %s as it was (%v)", dest, err)
	}
}
