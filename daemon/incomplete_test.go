package daemon

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/internal/repair"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// connackOf sends a CONNECT to addr and returns the CONNACK's reason code
// and Server Reference.
func connackOf(t *testing.T, addr, id string) (byte, string) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := paho.NewClient(paho.ClientConfig{ClientID: id, Conn: conn})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 30})
	if ca == nil {
		t.Fatalf("connect %s: %v", id, err)
	}
	if ca.ReasonCode == 0 {
		_ = c.Disconnect(&paho.Disconnect{})
	}
	ref := ""
	if ca.Properties != nil {
		ref = ca.Properties.ServerReference
	}
	return ca.ReasonCode, ref
}

// The slave of 2 gateways stopped while the master's snapshot was being
// merged into its broker state (in part: its state is marked incomplete).
// Started again while the master is down, it does not take devices (CONNACK
// 0x9C naming the master, status says why) and refuses a promotion; once
// the master is back, with every entry the slave lacks in its log, the
// slave asks for the snapshot instead of taking those entries, installs
// it, holds the master's retained set and takes devices again.
func TestSlaveWithAnIncompleteStateTakesNoDevicesUntilTheSnapshotIsInstalled(t *testing.T) {
	const n, size = 800, 1000 // 0.8 MB of retained messages: merged in place
	g1, g2 := inProcessPair(t, nil)
	pub, _ := v5(t, g1.d.MQTTAddr(), "pub", nil)
	retain := func(gen string) {
		for i := range n {
			payload := fmt.Appendf(nil, "%s-%d-", gen, i)
			payload = append(payload, strings.Repeat("p", size-len(payload))...)
			publish(t, pub, &paho.Publish{Topic: fmt.Sprintf("ret/%d", i), QoS: 1, Retain: true, Payload: payload})
		}
	}
	retain("old")
	testutil.WaitFor(t, 20*time.Second, "gw-2 caught up", func() bool {
		return statusOfGW(t, g2.d).Log.AppliedIndex >= statusOfGW(t, g1.d).Log.CommitIndex
	})
	if err := g2.d.Stop(); err != nil {
		t.Fatal(err)
	}
	retain("new")
	var snap pb.Snapshot
	testutil.WaitFor(t, 20*time.Second, "gw-1's snapshot built", func() bool {
		var err error
		snap, err = g1.d.db.Snapshot()
		if err != nil && !errors.Is(err, raft.ErrSnapshotTemporarilyUnavailable) {
			t.Fatal(err)
		}
		return err == nil
	})
	if f := statusOfGW(t, g1.d).Log.FirstIndex; f != 1 {
		t.Fatalf("gw-1's log starts at %d: it must hold every entry gw-2 lacks", f)
	}
	want := retainedOf(t, g1.d, "want", n)

	// gw-2's data file, the merge of that snapshot begun and cut.
	cutMergeShort(t, g2.dir, snap)

	if err := g1.d.Stop(); err != nil {
		t.Fatal(err)
	}
	g2.start(t, nil)
	if code, sref := connackOf(t, g2.d.MQTTAddr(), "early"); code != 0x9C || sref == "" {
		t.Fatalf("a CONNECT to gw-2 with its state incomplete: CONNACK %#x, server reference %q; want 0x9C naming gw-1", code, sref)
	}
	if why := g2.d.notServing(); why == nil || !strings.Contains(why.Error(), "incomplete") {
		t.Errorf("gw-2's health with its state incomplete: %v", why)
	}
	if code, msg := api(t, g2.d, "/v1/cluster/promote", admin.PromoteRequest{}, nil); code == http.StatusOK || !strings.Contains(msg, "incomplete") {
		t.Errorf("promoting gw-2 with its state incomplete: %d %q", code, msg)
	}

	g1.start(t, nil)
	testutil.WaitFor(t, 30*time.Second, "gw-2 to install gw-1's snapshot", func() bool { return !g2.d.db.InstallInterrupted() })
	testutil.WaitFor(t, 10*time.Second, "gw-2 to take devices", func() bool { return g2.d.notServing() == nil })
	if got := retainedOf(t, g2.d, "got", n); !maps.Equal(got, want) {
		t.Errorf("gw-2 holds %d retained messages, gw-1 %d, or they differ", len(got), len(want))
	}
}

// connack3 sends an MQTT 3.1.1 CONNECT to addr and returns the CONNACK's
// return code.
func connack3(t *testing.T, addr, id string) byte {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := append([]byte{0, 4, 'M', 'Q', 'T', 'T', 4, 0x02, 0, 30, 0, byte(len(id))}, id...)
	if _, err := conn.Write(testutil.MQTTFrame(0x10, body)); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	first, ack, err := testutil.ReadMQTTFrame(conn)
	if err != nil || first != 0x20 || len(ack) != 2 {
		t.Fatalf("3.1.1 CONNECT %s: %#x %x %v; want a CONNACK", id, first, ack, err)
	}
	return ack[1]
}

// copyDataDir copies the stopped gateway's data dir src into a new one,
// file modes kept (the node's key is private).
func copyDataDir(t *testing.T, src string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "copy")
	err := filepath.WalkDir(src, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		fi, err := e.Info()
		if err != nil {
			return err
		}
		if e.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), fi.Mode().Perm())
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, fi.Mode().Perm())
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

// A lone gateway whose broker state is marked incomplete (a snapshot's
// install was cut short: part of its retained messages are the snapshot's,
// part its own older ones) has no other member to name and none to send it
// a snapshot. It takes no devices all the same (CONNACK 0x88, 3.1.1 0x03:
// it would serve them a part-old, part-new state), and /v1/status, the
// health check and the log say why and what the operator can do. Stopped,
// `tandem repair --accept-incomplete` accepts the state as it is and
// clears the mark, with a warning; started again, the gateway takes
// devices and serves the merged state.
func TestLoneGatewayWithAnIncompleteStateRefusesDevicesUntilTheOperatorAcceptsIt(t *testing.T) {
	const n, size = 800, 1000 // 0.8 MB of retained messages: merged in place
	dir := t.TempDir()
	retain := func(d *Daemon, gen string) {
		pub, _ := v5(t, d.MQTTAddr(), "pub", nil)
		defer pub.Disconnect(&paho.Disconnect{})
		for i := range n {
			payload := fmt.Appendf(nil, "%s-%d-", gen, i)
			payload = append(payload, strings.Repeat("p", size-len(payload))...)
			publish(t, pub, &paho.Publish{Topic: fmt.Sprintf("ret/%d", i), QoS: 1, Retain: true, Payload: payload})
		}
	}
	gw := testGateway(t, dir, nil)
	retain(gw, "old")
	if err := gw.Stop(); err != nil {
		t.Fatal(err)
	}
	marked := copyDataDir(t, dir) // the state "old", to be merged into

	gw = testGateway(t, dir, nil)
	retain(gw, "new")
	var snap pb.Snapshot
	testutil.WaitFor(t, 20*time.Second, "the snapshot of the state \"new\" built", func() bool {
		var err error
		snap, err = gw.db.Snapshot()
		if err != nil && !errors.Is(err, raft.ErrSnapshotTemporarilyUnavailable) {
			t.Fatal(err)
		}
		return err == nil
	})
	if err := gw.Stop(); err != nil {
		t.Fatal(err)
	}

	// The copy's broker state, that snapshot's merge begun and cut.
	cutMergeShort(t, marked, snap)

	logs := &testutil.Buffer{}
	gw = startGatewayIn(t, marked, nil, logs)
	if code, sref := connackOf(t, gw.MQTTAddr(), "v5"); code != 0x88 || sref != "" {
		t.Errorf("MQTT 5 CONNECT to the marked lone gateway: CONNACK %#x, server reference %q; want 0x88 and none", code, sref)
	}
	if code := connack3(t, gw.MQTTAddr(), "v3"); code != 0x03 {
		t.Errorf("3.1.1 CONNECT to the marked lone gateway: CONNACK %#x; want 0x03 server unavailable", code)
	}
	way := "tandem repair --accept-incomplete --data " + marked
	s := statusOfGW(t, gw)
	if s.NotServing == nil || !strings.Contains(*s.NotServing, "incomplete") || !strings.Contains(*s.NotServing, way) || s.Serving != admin.ServingNone {
		t.Errorf("status of the marked lone gateway: serving %q, not_serving %v; want %q and a reason naming `%s`", s.Serving, s.NotServing, admin.ServingNone, way)
	}
	if code, body := healthz(t, gw); code != http.StatusServiceUnavailable || !strings.Contains(body, way) {
		t.Errorf("/healthz of the marked lone gateway: %d %q", code, body)
	}
	if logs.Count(way) == 0 {
		t.Errorf("the log does not say what to do: %s", logs.Tail(20))
	}

	// Its operator accepts the state as it is.
	if err := gw.Stop(); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := repair.Run(&out, marked, repair.Options{AcceptIncomplete: true}); err != nil {
		t.Fatalf("repair --accept-incomplete: %v\n%s", err, out.String())
	}
	t.Logf("tandem repair --accept-incomplete said:\n%s", out.String())
	if !strings.Contains(out.String(), "WARNING") || !strings.Contains(out.String(), "accepted as it is") {
		t.Errorf("repair --accept-incomplete gave no warning:\n%s", out.String())
	}
	out.Reset()
	if err := repair.Run(&out, marked, repair.Options{AcceptIncomplete: true}); !errors.Is(err, storage.ErrNotIncomplete) {
		t.Errorf("repair --accept-incomplete of a dir no longer marked: %v; want ErrNotIncomplete", err)
	}

	gw = testGateway(t, marked, nil)
	testutil.WaitFor(t, 10*time.Second, "the gateway to take devices", func() bool { return gw.notServing() == nil })
	if code, _ := connackOf(t, gw.MQTTAddr(), "back"); code != 0 {
		t.Errorf("CONNECT once the state is accepted: CONNACK %#x", code)
	}
	got := retainedOf(t, gw, "got", n)
	gens := map[string]int{}
	for _, p := range got {
		gen, _, _ := strings.Cut(p, "-")
		gens[gen]++
	}
	t.Logf("retained messages served after the accept: %v", gens)
	if len(got) != n || gens["new"] == 0 {
		t.Errorf("served %d retained messages (%v); want %d, the merged part of them the snapshot's", len(got), gens, n)
	}
}

// cutMergeShort opens the data dir dir, stopped, receives snap into it
// until its merge in place has begun, and cuts the receive there: the
// broker state is marked incomplete.
func cutMergeShort(t *testing.T, dir string, snap pb.Snapshot) {
	t.Helper()
	db, err := storage.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	body := snap.Data
	if _, isRef := storage.ParseSnapshotRef(body); isRef {
		t.Fatal("the snapshot is past the inline limit: this test feeds its body")
	}
	ref := storage.SnapshotRef{Index: snap.Metadata.Index, Size: uint64(len(body)), CRC: binary.BigEndian.Uint32(body[len(body)-4:])}
	in, err := db.ReceiveSnapshot(ref)
	if err != nil {
		t.Fatal(err)
	}
	for !db.InstallInterrupted() {
		if in.Done() {
			t.Fatal("the whole snapshot was received without a merge in place")
		}
		if err := in.Write(body[in.Offset():min(in.Offset()+64<<10, ref.Size)]); err != nil {
			t.Fatal(err)
		}
	}
	in.Close()
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
}
