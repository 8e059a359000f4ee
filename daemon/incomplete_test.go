package daemon

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/admin"
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
	db, err := storage.Open(g2.dir, nil)
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
