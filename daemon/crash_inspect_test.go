package daemon_test

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"
)

// ---------------------------------------------------------------------------
// Test 3: inspect changes nothing, also after an unclean stop.

// fileState is what dirState records of one file.
type fileState struct {
	mode  fs.FileMode
	size  int64
	mtime time.Time
	sum   string
}

// dirState records every file under dir: mode, size, mtime and SHA-256.
func dirState(t *testing.T, dir string) map[string]fileState {
	t.Helper()
	out := map[string]fileState{}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		info, err := d.Info()
		if err != nil {
			return err
		}
		st := fileState{mode: info.Mode(), size: info.Size(), mtime: info.ModTime()}
		if d.IsDir() {
			st.size = 0 // a directory's size says nothing about its entries
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(path)
			if err != nil {
				return err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return err
			}
			st.sum = hex.EncodeToString(h.Sum(nil))
		}
		out[rel] = st
		return nil
	})
	if err != nil {
		t.Fatalf("reading %s: %v", dir, err)
	}
	return out
}

func compareDirState(t *testing.T, what string, before, after map[string]fileState) {
	t.Helper()
	var names []string
	for n := range before {
		names = append(names, n)
	}
	for n := range after {
		if _, ok := before[n]; !ok {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	for _, n := range names {
		b, okb := before[n]
		a, oka := after[n]
		switch {
		case !okb:
			t.Errorf("%s created %s", what, n)
		case !oka:
			t.Errorf("%s removed %s", what, n)
		case a != b:
			t.Errorf("%s changed %s: before %+v, after %+v", what, n, b, a)
		}
	}
}

func TestInspectLeavesDataUntouched(t *testing.T) {
	dir := t.TempDir()
	p := startTandem(t, dir, nil)

	// A persistent session with a QoS 2 publish half done, so the file
	// holds session state as well as log entries.
	raw := dialMQTT(t, p.addrs.mqtt, 4)
	raw.connect("inspect-session", false)
	raw.send(raw.publishPacket("inspect/qos2", 2, false, 1, []byte("half done")))
	raw.expectAck(pktPubrec, 1, 0)

	// QoS 1 load, then SIGKILL with publishes in flight.
	var connected, done sync.WaitGroup
	stop := make(chan struct{})
	var res pubResult
	connected.Add(1)
	done.Add(1)
	go func() {
		defer done.Done()
		publish(p.addrs.mqtt, "inspectPub", 0, &connected, stop, &res)
	}()
	connected.Wait()
	if res.connErr != nil {
		t.Fatal(res.connErr)
	}
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(5 * time.Millisecond)
	for res.progress.Load() < 200 && time.Now().Before(deadline) {
		<-tick.C
	}
	tick.Stop()
	p.kill9()
	close(stop)
	done.Wait()
	raw.c.Close()
	t.Logf("killed with %d QoS 1 publishes sent, %d acked", res.sent, len(res.acked))

	before := dirState(t, dir)
	recs := runInspect(t, dir)
	if len(recs) == 0 {
		t.Errorf("inspect printed no records")
	}
	compareDirState(t, "tandem inspect", before, dirState(t, dir))
	runInspect(t, dir, "--all", "--from", "2", "--limit", "5")
	compareDirState(t, "tandem inspect --all --from 2 --limit 5", before, dirState(t, dir))
}
