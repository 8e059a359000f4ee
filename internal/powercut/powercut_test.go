package powercut

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

// mount serves a fresh backing dir (or the one given) and unmounts at the
// end. Without FUSE it skips, and fails under CI=true.
func mount(t *testing.T, backing string, seed uint64) *FS {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("power-cut filesystem needed under CI: %v", err)
		}
		t.Skipf("power-cut filesystem: %v (needs root and /dev/fuse)", err)
	}
	if backing == "" {
		backing = filepath.Join(t.TempDir(), "backing")
		if err := os.Mkdir(backing, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mnt := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	p, err := Mount(backing, mnt, &Options{Seed: seed})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Unmount() })
	return p
}

// cut cuts the power, unmounts, and returns the backing dir.
func cut(t *testing.T, p *FS, tear bool) (string, CutReport) {
	t.Helper()
	r := p.Cut(tear)
	if err := p.Unmount(); err != nil {
		t.Fatal(err)
	}
	return p.Backing(), r
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func syncPath(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	must(t, err)
	defer f.Close()
	must(t, f.Sync())
}

func fdatasync(t *testing.T, f *os.File) {
	t.Helper()
	must(t, syscall.Fdatasync(int(f.Fd())))
}

// create makes a file with content, fsynced along with its directory.
func create(t *testing.T, dir, name, content string) {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, name))
	must(t, err)
	_, err = f.WriteString(content)
	must(t, err)
	must(t, f.Sync())
	must(t, f.Close())
	syncPath(t, dir)
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	must(t, err)
	return string(b)
}

func wantAbsent(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s survived the cut (stat: %v)", path, err)
	}
}

func TestCutDropsUnsyncedWritesAndKeepsSyncedOnes(t *testing.T) {
	p := mount(t, "", 1)
	create(t, p.Dir(), "f", "synced|")
	f, err := os.OpenFile(filepath.Join(p.Dir(), "f"), os.O_RDWR, 0)
	must(t, err)
	_, err = f.WriteAt([]byte("fdatasynced|"), 7)
	must(t, err)
	fdatasync(t, f)
	_, err = f.WriteAt([]byte("LOST"), 0)
	must(t, err)
	_, err = f.WriteAt([]byte("lost tail"), 19)
	must(t, err)
	if got := readFile(t, filepath.Join(p.Dir(), "f")); got != "LOSTed|fdatasynced|lost tail" {
		t.Fatalf("the view reads %q, want the unsynced writes in it", got)
	}
	must(t, f.Close())
	backing, r := cut(t, p, false)
	if got := readFile(t, filepath.Join(backing, "f")); got != "synced|fdatasynced|" {
		t.Fatalf("after the cut the file holds %q, want exactly what was synced", got)
	}
	if r.Writes != 2 {
		t.Fatalf("the cut reports %d writes dropped, want 2", r.Writes)
	}
}

// Two files synced one at a time: the later fsync of one says nothing of
// the other's writes; LostFrom names the first write the cut dropped.
func TestLostFromIsTheFirstDroppedWriteOfAnyFile(t *testing.T) {
	p := mount(t, "", 1)
	create(t, p.Dir(), "log.0", "")
	create(t, p.Dir(), "log.1", "")
	a, err := os.OpenFile(filepath.Join(p.Dir(), "log.0"), os.O_RDWR, 0)
	must(t, err)
	defer a.Close()
	b, err := os.OpenFile(filepath.Join(p.Dir(), "log.1"), os.O_RDWR, 0)
	must(t, err)
	defer b.Close()
	_, err = a.WriteAt([]byte("synced"), 0)
	must(t, err)
	fdatasync(t, a)
	before := time.Now()
	_, err = b.WriteAt([]byte("lost"), 0) // never synced
	must(t, err)
	between := time.Now()
	_, err = a.WriteAt([]byte("synced too"), 6)
	must(t, err)
	fdatasync(t, a)
	if at := p.LostFrom("log."); !at.IsZero() {
		t.Fatalf("LostFrom before the cut = %v, want zero", at)
	}
	p.Cut(false)
	at := p.LostFrom("log.")
	if at.Before(before) || at.After(between) {
		t.Fatalf("LostFrom = %v, want the write to log.1 (between %v and %v)", at, before, between)
	}
	if at := p.LostFrom("log.0"); !at.IsZero() {
		t.Fatalf("LostFrom(log.0) = %v, want zero: all of it was synced", at)
	}
}

func TestCutRestoresTheSyncedSize(t *testing.T) {
	p := mount(t, "", 1)
	create(t, p.Dir(), "shrunk", "0123456789")
	create(t, p.Dir(), "grown", "0123")
	create(t, p.Dir(), "resized", "abcdef")
	must(t, os.Truncate(filepath.Join(p.Dir(), "shrunk"), 3))
	f, err := os.OpenFile(filepath.Join(p.Dir(), "grown"), os.O_RDWR|os.O_APPEND, 0)
	must(t, err)
	_, err = f.WriteString("4567")
	must(t, err)
	must(t, f.Close())
	// A truncate then a write past it: the view reads zeros between, and a
	// sync keeps both.
	g, err := os.OpenFile(filepath.Join(p.Dir(), "resized"), os.O_RDWR, 0)
	must(t, err)
	must(t, g.Truncate(2))
	_, err = g.WriteAt([]byte("Z"), 4)
	must(t, err)
	if got := readFile(t, filepath.Join(p.Dir(), "resized")); got != "ab\x00\x00Z" {
		t.Fatalf("the view reads %q after truncate and write", got)
	}
	fdatasync(t, g)
	must(t, g.Close())
	if fi, err := os.Stat(filepath.Join(p.Dir(), "shrunk")); err != nil || fi.Size() != 3 {
		t.Fatalf("the view's size: %v %v", fi, err)
	}
	backing, _ := cut(t, p, false)
	for name, want := range map[string]string{"shrunk": "0123456789", "grown": "0123", "resized": "ab\x00\x00Z"} {
		if got := readFile(t, filepath.Join(backing, name)); got != want {
			t.Errorf("%s holds %q after the cut, want %q", name, got, want)
		}
	}
}

func TestANewNameLastsOnlyOnceItsDirectoryIsSynced(t *testing.T) {
	p := mount(t, "", 1)
	// Data synced, directory not: the file is gone.
	must(t, os.Mkdir(filepath.Join(p.Dir(), "nosync"), 0o755))
	f, err := os.Create(filepath.Join(p.Dir(), "nosync", "unnamed"))
	must(t, err)
	_, err = f.WriteString("data")
	must(t, err)
	must(t, f.Sync())
	must(t, f.Close())
	// Directory synced, data not: the name survives, empty.
	g, err := os.Create(filepath.Join(p.Dir(), "empty"))
	must(t, err)
	_, err = g.WriteString("data")
	must(t, err)
	must(t, g.Close())
	must(t, os.Mkdir(filepath.Join(p.Dir(), "sub"), 0o755))
	syncPath(t, p.Dir())
	// A file in a directory that was synced, under one that was too.
	create(t, filepath.Join(p.Dir(), "sub"), "kept", "in sub")
	// A directory synced itself, its parent not: gone with its files.
	must(t, os.MkdirAll(filepath.Join(p.Dir(), "sub", "orphan"), 0o755))
	create(t, filepath.Join(p.Dir(), "sub", "orphan"), "lost", "x")
	// Synced after being made, the file is there: late is fine.
	create(t, p.Dir(), "late", "late")
	backing, r := cut(t, p, false)
	wantAbsent(t, filepath.Join(backing, "nosync", "unnamed"))
	wantAbsent(t, filepath.Join(backing, "sub", "orphan"))
	if got := readFile(t, filepath.Join(backing, "empty")); got != "" {
		t.Errorf("empty holds %q, want nothing: its data was never synced", got)
	}
	if got := readFile(t, filepath.Join(backing, "sub", "kept")); got != "in sub" {
		t.Errorf("sub/kept holds %q", got)
	}
	if got := readFile(t, filepath.Join(backing, "late")); got != "late" {
		t.Errorf("late holds %q", got)
	}
	if r.Names != 2 {
		t.Errorf("the cut reports %d names dropped, want 2 (nosync/unnamed, sub/orphan)", r.Names)
	}
	ents, err := os.ReadDir(filepath.Dir(backing))
	must(t, err)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".powercut-scratch") {
			t.Errorf("the scratch dir %s is left after the cut", e.Name())
		}
	}
}

func TestRenameAndUnlinkLastOnlyOnceTheDirectoryIsSynced(t *testing.T) {
	p := mount(t, "", 1)
	dir := p.Dir()
	create(t, dir, "victim", "old")
	create(t, dir, "tmp", "new")
	create(t, dir, "gone", "x")
	create(t, dir, "staying", "y")
	// Replace victim by tmp, remove gone; sync: all of it holds.
	must(t, os.Rename(filepath.Join(dir, "tmp"), filepath.Join(dir, "victim")))
	must(t, os.Remove(filepath.Join(dir, "gone")))
	syncPath(t, dir)
	// Then rename and remove again without a sync: undone by the cut.
	create(t, dir, "tmp2", "newer")
	syncPath(t, dir)
	must(t, os.Rename(filepath.Join(dir, "tmp2"), filepath.Join(dir, "victim")))
	must(t, os.Remove(filepath.Join(dir, "staying")))
	if got := readFile(t, filepath.Join(dir, "victim")); got != "newer" {
		t.Fatalf("the view reads %q", got)
	}
	backing, r := cut(t, p, false)
	if got := readFile(t, filepath.Join(backing, "victim")); got != "new" {
		t.Errorf("victim holds %q after the cut, want the synced rename's %q", got, "new")
	}
	wantAbsent(t, filepath.Join(backing, "tmp"))
	wantAbsent(t, filepath.Join(backing, "gone"))
	if got := readFile(t, filepath.Join(backing, "tmp2")); got != "newer" {
		t.Errorf("tmp2 holds %q, want it back under its synced name", got)
	}
	if got := readFile(t, filepath.Join(backing, "staying")); got != "y" {
		t.Errorf("staying holds %q, want its unsynced unlink undone", got)
	}
	if r.Names != 3 { // victim changed, tmp2 and staying gone
		t.Errorf("the cut reports %d names dropped, want 3", r.Names)
	}
}

func TestMountShowsWhatBackingHoldsAndKeepsIt(t *testing.T) {
	backing := filepath.Join(t.TempDir(), "backing")
	must(t, os.MkdirAll(filepath.Join(backing, "d"), 0o755))
	must(t, os.WriteFile(filepath.Join(backing, "d", "a"), []byte("before"), 0o644))
	p := mount(t, backing, 1)
	if got := readFile(t, filepath.Join(p.Dir(), "d", "a")); got != "before" {
		t.Fatalf("the mount shows %q", got)
	}
	must(t, os.WriteFile(filepath.Join(p.Dir(), "d", "a"), []byte("unsynced"), 0o644))
	cut(t, p, false)
	if got := readFile(t, filepath.Join(backing, "d", "a")); got != "before" {
		t.Fatalf("backing holds %q", got)
	}
}

func TestEverythingFailsAfterTheCut(t *testing.T) {
	p := mount(t, "", 1)
	create(t, p.Dir(), "f", "x")
	f, err := os.OpenFile(filepath.Join(p.Dir(), "f"), os.O_RDWR, 0)
	must(t, err)
	t.Cleanup(func() { f.Close() }) // before the mount's cleanup
	p.Cut(false)
	if _, err := f.WriteAt([]byte("y"), 0); !errors.Is(err, syscall.EIO) {
		t.Errorf("a write after the cut: %v, want EIO", err)
	}
	if err := f.Sync(); !errors.Is(err, syscall.EIO) {
		t.Errorf("an fsync after the cut: %v, want EIO", err)
	}
	if _, err := os.Create(filepath.Join(p.Dir(), "g")); err == nil {
		t.Error("a create after the cut succeeded")
	}
	if got := readFile(t, filepath.Join(p.Dir(), "f")); got != "x" {
		t.Errorf("a read after the cut gives %q, want the view of the cut", got)
	}
}

// TestATornWriteKeepsWholeSectors writes four sectors and cuts with a tear:
// a prefix of whole sectors, at least one and not all, reaches the file,
// the same one for the same seed.
func TestATornWriteKeepsWholeSectors(t *testing.T) {
	run := func(seed uint64) (string, CutReport) {
		p := mount(t, "", seed)
		create(t, p.Dir(), "f", strings.Repeat("o", 4*SectorSize))
		f, err := os.OpenFile(filepath.Join(p.Dir(), "f"), os.O_RDWR, 0)
		must(t, err)
		_, err = f.WriteAt([]byte("early"), 0) // not the last: dropped whole
		must(t, err)
		// Starts mid-sector: five pieces, cut at sector boundaries.
		_, err = f.WriteAt(bytes.Repeat([]byte("n"), 4*SectorSize-100), 100)
		must(t, err)
		f.Close()
		backing, r := cut(t, p, true)
		return readFile(t, filepath.Join(backing, "f")), r
	}
	seen := map[int]bool{}
	for seed := uint64(1); seed <= 8; seed++ {
		got, r := run(seed)
		if !r.Tore {
			t.Fatalf("seed %d: no tear reported", seed)
		}
		n := strings.Count(got, "n")
		if got[:100] != strings.Repeat("o", 100) || n == 0 || n == 4*SectorSize-100 || (n+100)%SectorSize != 0 ||
			got[100:100+n] != strings.Repeat("n", n) || got[100+n:] != strings.Repeat("o", 4*SectorSize-100-n) {
			t.Fatalf("seed %d: the torn file is not a prefix of whole sectors: %d new bytes (%s)", seed, n, r.Torn)
		}
		seen[n] = true
		again, _ := run(seed)
		if again != got {
			t.Fatalf("seed %d tears differently on a second run", seed)
		}
	}
	if len(seen) < 2 {
		t.Errorf("8 seeds tore the write at only %d place(s)", len(seen))
	}
}

// TestBboltOnTheMount runs bbolt (shared read mmap, pwrite, fdatasync) on
// the mount and cuts in the middle of a commit: every commit before it is
// there, the one cut is not (or, torn, is there whole), and the file
// checks out. bbolt runs in a child process: a process that faults on a
// mapping of a FUSE file it serves itself deadlocks with its own garbage
// collector (the faulting thread cannot stop, the serving ones are stopped).
func TestBboltOnTheMount(t *testing.T) {
	for _, when := range []struct {
		name string
		kind Kind
		skip int // operations of that kind to let pass
		tear bool
	}{
		{"first page write", Write, 0, false},
		{"second write, torn", Write, 1, true},
		{"meta page sync", Sync, 1, false},
		// The new meta sits in the first sectors of its page: a tear
		// that keeps them makes the commit, whose pages were synced.
		{"meta page sync, torn", Sync, 1, true},
	} {
		t.Run(when.name, func(t *testing.T) {
			p := mount(t, "", 7)
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "POWERCUT_BBOLT_HELPER="+filepath.Join(p.Dir(), "b.db"))
			in, err := cmd.StdinPipe()
			must(t, err)
			out, err := cmd.StdoutPipe()
			must(t, err)
			cmd.Stderr = os.Stderr
			must(t, cmd.Start())
			defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
			lines := bufio.NewScanner(out)
			if !lines.Scan() || lines.Text() != "ready" {
				t.Fatalf("the helper says %q, want ready", lines.Text())
			}
			seen := 0
			p.CutWhen(func(o Op) bool {
				if o.Kind != when.kind || o.Path != "b.db" {
					return false
				}
				seen++
				return seen > when.skip
			}, when.tear)
			_, err = in.Write([]byte("go\n"))
			must(t, err)
			if !lines.Scan() || !strings.HasPrefix(lines.Text(), "failed") {
				t.Fatalf("the commit cut by the power gave %q, want it failed", lines.Text())
			}
			<-p.Done()
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			backing, r := cut(t, p, false)
			t.Logf("cut at %+v: dropped %d writes; torn: %q", r.Op, r.Writes, r.Torn)
			db, err := bolt.Open(filepath.Join(backing, "b.db"), 0o600, nil)
			must(t, err)
			defer db.Close()
			must(t, db.View(func(tx *bolt.Tx) error {
				var errs []error
				for err := range tx.Check() {
					errs = append(errs, err)
				}
				if len(errs) > 0 {
					return fmt.Errorf("bbolt's check: %v", errs)
				}
				b := tx.Bucket([]byte("b"))
				for i := range 50 {
					if v := b.Get(fmt.Appendf(nil, "%04d", i)); len(v) != 3000 || v[0] != byte(i) {
						return fmt.Errorf("commit %d lost", i)
					}
				}
				v := b.Get([]byte("0050"))
				switch {
				case v == nil:
				case !when.tear:
					return errors.New("the cut commit is there")
				case len(v) != 3000 || v[0] != 50:
					return fmt.Errorf("the torn commit is there, damaged: %d bytes", len(v))
				}
				return nil
			}))
		})
	}
}

func TestMain(m *testing.M) {
	if path := os.Getenv("POWERCUT_BBOLT_HELPER"); path != "" {
		os.Exit(bboltHelper(path))
	}
	os.Exit(m.Run())
}

// bboltHelper commits 50 transactions to a new bbolt file at path (and
// its directory), reads the last back through the mapping, says "ready",
// and on a line from stdin commits one more: "failed: ERR" or "committed".
func bboltHelper(path string) int {
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		fmt.Println("open:", err)
		return 1
	}
	if d, err := os.Open(filepath.Dir(path)); err != nil || d.Sync() != nil {
		fmt.Println("sync dir failed")
		return 1
	}
	put := func(i int) error {
		return db.Update(func(tx *bolt.Tx) error {
			b, err := tx.CreateBucketIfNotExists([]byte("b"))
			if err != nil {
				return err
			}
			return b.Put(fmt.Appendf(nil, "%04d", i), bytes.Repeat([]byte{byte(i)}, 3000))
		})
	}
	for i := range 50 {
		if err := put(i); err != nil {
			fmt.Println("put:", err)
			return 1
		}
	}
	if err := db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket([]byte("b")).Get([]byte("0049")); len(v) != 3000 || v[0] != 49 {
			return fmt.Errorf("the mapping reads %d bytes for the last key", len(v))
		}
		return nil
	}); err != nil {
		fmt.Println(err)
		return 1
	}
	fmt.Println("ready")
	bufio.NewScanner(os.Stdin).Scan()
	if err := put(50); err != nil {
		fmt.Println("failed:", err)
		return 0
	}
	fmt.Println("committed")
	return 0
}
