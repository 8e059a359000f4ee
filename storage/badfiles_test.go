package storage

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// ---------------------------------------------------------------------------
// 5. Bad files

// openChecked runs Open and turns a panic into a test failure, so one bad
// case does not take the whole package down.
func openChecked(t *testing.T, dir string, opts *Options) (db *DB, err error) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("Open panicked: %v", r)
		}
	}()
	return Open(dir, opts)
}

func TestOpenRejectsBadFiles(t *testing.T) {
	path := func(dir string) string { return filepath.Join(dir, FileName) }
	truncate := func(size func(dir string, need int64) int64) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			t.Helper()
			writeLog(t, dir, 400)
			var need int64
			boltView(t, path(dir), func(tx *bolt.Tx) error { need = tx.Size(); return nil })
			sz := size(dir, need)
			if sz >= need {
				t.Fatalf("fixture: truncating to %d bytes keeps all %d bytes the file needs", sz, need)
			}
			if err := os.Truncate(path(dir), sz); err != nil {
				t.Fatal(err)
			}
		}
	}
	garbage := func(n int) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			b := make([]byte, n)
			r := rand.NewChaCha8([32]byte{'t', 'a', 'n', 'd', 'e', 'm'})
			r.Read(b)
			if err := os.WriteFile(path(dir), b, 0o640); err != nil {
				t.Fatal(err)
			}
		}
	}
	cases := []struct {
		name  string
		setup func(t *testing.T, dir string)
		want  error
		names string // a number the message must name, e.g. the entry's index
	}{
		{"zero length", func(t *testing.T, dir string) {
			if err := os.WriteFile(path(dir), nil, 0o640); err != nil {
				t.Fatal(err)
			}
		}, ErrCorrupt, ""},
		// Half of what it needs: the file itself is larger, with zeroed
		// space past bbolt's high-water mark (prefill).
		{"truncated to half", truncate(func(_ string, need int64) int64 { return need / 2 }), ErrCorrupt, ""},
		{"truncated by one page", truncate(func(_ string, need int64) int64 { return need - 4096 }), ErrCorrupt, ""},
		{"truncated to 4096 bytes", truncate(func(string, int64) int64 { return 4096 }), ErrCorrupt, ""},
		{"10 bytes of garbage", garbage(10), ErrCorrupt, ""},
		{"64 KiB of garbage", garbage(64 << 10), ErrCorrupt, ""},
		{"locked by another open DB", func(t *testing.T, dir string) {
			writeLog(t, dir, 10)
			testOpen(t, dir, nil) // held until the test ends
		}, ErrInUse, ""},
		{"entry data byte flipped", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error { return flipLastByte(tx, 37) })
		}, ErrCorrupt, "37"},
		{"entry missing from the log", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error { return splitRunAround(tx, 23) })
		}, ErrCorrupt, "23"},
		{"run key with an unknown tag", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				return rekeyRun(tx, 30, func(k []byte) []byte { k[8] = 7; return k })
			})
		}, ErrCorrupt, ""},
		{"log key of 10 bytes", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				return rekeyRun(tx, 30, func(k []byte) []byte { return append(k, 0) })
			})
		}, ErrCorrupt, ""},
		{"entry length inside a run past its end", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				b := tx.Bucket(bucketLog)
				k, v, start, _, err := entryAt(b, 37)
				if err != nil {
					return err
				}
				v = bytes.Clone(v)
				binary.PutUvarint(v[start:], uint64(len(v))) // same width: entries are 213 bytes
				return b.Put(bytes.Clone(k), v)
			})
		}, ErrCorrupt, "37"},
		{"empty value under the last entry's key (format 2)", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				if err := singleEntryKeys(tx); err != nil {
					return err
				}
				if err := putCommit(tx, 10); err != nil { // no "commit past the last entry" to help
					return err
				}
				return tx.Bucket(bucketLog).Put(u64(50), []byte{})
			})
		}, ErrCorrupt, "50"},
		{"bucket under an entry's key (format 2)", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				if err := singleEntryKeys(tx); err != nil {
					return err
				}
				if err := putCommit(tx, 10); err != nil {
					return err
				}
				b := tx.Bucket(bucketLog)
				if err := b.Delete(u64(50)); err != nil {
					return err
				}
				_, err := b.CreateBucket(u64(50))
				return err
			})
		}, ErrCorrupt, "50"},
		{"commit index past the last entry", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				hs := pb.HardState{Term: 1, Vote: 1, Commit: 80}
				b, err := hs.Marshal()
				if err != nil {
					return err
				}
				return tx.Bucket(bucketRaftState).Put(keyHardState, b)
			})
		}, ErrCorrupt, ""},
		{"format version from a newer tandem", func(t *testing.T, dir string) {
			writeLog(t, dir, 10)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error { return tx.Bucket(bucketMeta).Put(keyFormat, u64(99)) })
		}, ErrUnknownVersion, "99"},
	}
	for _, tc := range cases {
		for _, ro := range []bool{false, true} {
			mode := "read-write"
			if ro {
				mode = "read-only"
			}
			t.Run(tc.name+"/"+mode, func(t *testing.T) {
				dir := t.TempDir()
				tc.setup(t, dir)
				before := fileHash(t, path(dir))
				names := dirNames(t, dir)
				opts := &Options{ReadOnly: ro, LockTimeout: 100 * time.Millisecond}

				start := time.Now()
				db, err := openChecked(t, dir, opts)
				took := time.Since(start)
				if err == nil {
					db.Close()
					t.Fatalf("Open succeeded, want an error wrapping %q", tc.want)
				}
				if !errors.Is(err, tc.want) {
					t.Errorf("Open: %v\nwant an error wrapping %q", err, tc.want)
				}
				if tc.names != "" {
					msg := strings.ReplaceAll(err.Error(), dir, "<dir>")
					if !regexp.MustCompile(`\b` + tc.names + `\b`).MatchString(msg) {
						t.Errorf("Open: %q does not name %s", msg, tc.names)
					}
				}
				if took > 2*time.Second {
					t.Errorf("Open took %v to fail with LockTimeout 100ms", took)
				}
				if fileHash(t, path(dir)) != before {
					t.Errorf("Open changed the file it rejected (%v)", err)
				}
				if got := dirNames(t, dir); !slices.Equal(got, names) {
					t.Errorf("data dir holds %v after the failed Open, before %v", got, names)
				}
			})
		}
	}
}

func TestOpenInUseUntilHolderCloses(t *testing.T) {
	dir := t.TempDir()
	want := writeLog(t, dir, 20)
	holder := testOpen(t, dir, nil)
	const lockTimeout = 100 * time.Millisecond
	start := time.Now()
	_, err := openChecked(t, dir, &Options{LockTimeout: lockTimeout})
	took := time.Since(start)
	if !errors.Is(err, ErrInUse) {
		t.Fatalf("Open of a held file: %v, want ErrInUse", err)
	}
	if took > lockTimeout+time.Second {
		t.Errorf("ErrInUse after %v with LockTimeout %v", took, lockTimeout)
	}
	mustClose(t, holder)
	// The next daemon starts once the old one has let go.
	db := testOpen(t, dir, &Options{LockTimeout: lockTimeout})
	got, err := db.Entries(1, 21, math.MaxUint64)
	if err != nil || diffEntries(got, want) != "" {
		t.Errorf("entries after the holder closed: %v %s", err, diffEntries(got, want))
	}
}

func TestReadOnlyOpenOfMissingDirCreatesNothing(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "no", "such", "dir")
	db, err := openChecked(t, dir, &Options{ReadOnly: true})
	if err == nil {
		db.Close()
		t.Fatal("read-only Open of a missing dir succeeded")
	}
	if _, serr := os.Stat(filepath.Dir(filepath.Dir(dir))); !errors.Is(serr, fs.ErrNotExist) {
		t.Errorf("read-only Open created %s (stat: %v)", filepath.Dir(filepath.Dir(dir)), serr)
	}

	// An existing dir without a data file: nothing created either.
	empty := t.TempDir()
	if db, err := openChecked(t, empty, &Options{ReadOnly: true}); err == nil {
		db.Close()
		t.Fatal("read-only Open of a dir without a data file succeeded")
	}
	if names := dirNames(t, empty); len(names) != 0 {
		t.Errorf("read-only Open created %v", names)
	}
}

// A power cut tears the newest meta page; bbolt then opens the previous
// commit (one that was never acked). That must work whatever page size the
// file was created with: bbolt uses the OS page size, which is 16 KiB on a
// Raspberry Pi 5 kernel and 64 KiB on some arm64 distributions.
func TestOpenFallsBackPastTornMetaPage(t *testing.T) {
	for _, pageSize := range []int{4096, 16384, 65536} {
		for _, torn := range []int{0, 1} {
			t.Run(fmt.Sprintf("page=%d/meta%d", pageSize, torn), func(t *testing.T) {
				dir := t.TempDir()
				path := filepath.Join(dir, FileName)
				bdb, err := bolt.Open(path, 0o640, &bolt.Options{PageSize: pageSize})
				if err != nil {
					t.Fatal(err)
				}
				bdb.Close()

				db := testOpen(t, dir, nil)
				first := makeEntries(1, 5, 1)
				mustSave(t, db, pb.HardState{Term: 1, Commit: 5}, first)
				mustCheckpoint(t, db)
				var txid int
				if err := db.bolt.View(func(tx *bolt.Tx) error { txid = tx.ID(); return nil }); err != nil {
					t.Fatal(err)
				}
				if (txid+1)%2 != torn { // bbolt writes commit N to meta page N%2
					if _, err := db.NextEpoch(); err != nil {
						t.Fatal(err)
					}
				}
				second := makeEntries(6, 5, 1)
				mustSave(t, db, pb.HardState{Term: 1, Commit: 10}, second)
				mustClose(t, db) // its checkpoint is the commit whose meta page tears

				boltView(t, path, func(tx *bolt.Tx) error {
					if tx.ID()%2 != torn || tx.DB().Info().PageSize != pageSize {
						t.Fatalf("fixture: last commit %d with page size %d, want meta%d and %d", tx.ID(), tx.DB().Info().PageSize, torn, pageSize)
					}
					return nil
				})
				xorByte(t, path, int64(torn*pageSize)+16+56, 0xff) // the meta page's checksum
				// bbolt itself falls back to the previous commit.
				boltView(t, path, func(tx *bolt.Tx) error {
					if last, err := lastLogIndex(tx.Bucket(bucketLog)); err != nil || last != 5 {
						t.Fatalf("fixture: bbolt does not fall back to the commit holding entries 1..5")
					}
					return nil
				})

				// The WAL frames of 6..10 carry the id that commit records:
				// they are replayed, so the torn checkpoint loses nothing.
				want := append(slices.Clone(first), second...)
				for _, ro := range []bool{true, false} {
					db, err := openChecked(t, dir, &Options{ReadOnly: ro})
					if err != nil {
						t.Fatalf("Open(ReadOnly=%v) after a torn meta page: %v", ro, err)
					}
					got, err := db.Entries(1, 11, math.MaxUint64)
					if d := diffEntries(got, want); err != nil || d != "" {
						t.Errorf("ReadOnly=%v: entries after the fallback: %v %s", ro, err, d)
					}
					if l, _ := db.LastIndex(); l != 10 {
						t.Errorf("ReadOnly=%v: LastIndex = %d, want 10", ro, l)
					}
					mustClose(t, db)
				}
			})
		}
	}
}

// childEnv, when set, makes TestOpenDamagedPage open that dir and print the
// outcome instead of running: bbolt may crash the process on a damaged
// page, and only a child process can show that without killing the suite.
const childEnv = "TANDEM_STORAGE_TEST_OPEN_DIR"

// execEnv names the emulator the test binary runs under, if any (make
// test-arm sets it to qemu's): the child is started through it.
const execEnv = "TANDEM_TEST_EXEC"

// A page of the log damaged on the medium (SD cards and eMMC do that) must
// stop the daemon with ErrCorrupt and a message, not a Go panic, and must
// not be written to.
func TestOpenDamagedPage(t *testing.T) {
	if dir := os.Getenv(childEnv); dir != "" {
		_, err := Open(dir, &Options{ReadOnly: os.Getenv(childEnv+"_RO") == "1", LockTimeout: 100 * time.Millisecond})
		fmt.Printf("\nOPEN-RESULT corrupt=%v err=%v\n", errors.Is(err, ErrCorrupt), err)
		return
	}
	for _, ro := range []bool{true, false} {
		t.Run(fmt.Sprintf("ReadOnly=%v", ro), func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, FileName)
			writeLog(t, dir, 400)
			// Give the first leaf page under the log bucket's root an
			// impossible page type.
			var leaf uint64
			var pageSize int64
			boltView(t, path, func(tx *bolt.Tx) error {
				pageSize = int64(tx.DB().Info().PageSize)
				root := uint64(tx.Bucket(bucketLog).RootPage())
				hdr := make([]byte, 32)
				f, err := os.Open(path)
				if err != nil {
					return err
				}
				defer f.Close()
				if _, err := f.ReadAt(hdr, int64(root)*pageSize); err != nil {
					return err
				}
				if hdr[8]&0x01 == 0 {
					t.Fatalf("fixture: the log bucket's root page %d is not a branch page", root)
				}
				leaf = binary.LittleEndian.Uint64(hdr[16+8:])
				return nil
			})
			f, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt([]byte{0x20, 0}, int64(leaf)*pageSize+8); err != nil {
				t.Fatal(err)
			}
			f.Close()
			before := fileHash(t, path)

			name, args := os.Args[0], []string{"-test.run=^TestOpenDamagedPage$", "-test.count=1"}
			if emu := os.Getenv(execEnv); emu != "" {
				// Under qemu-user (make test-arm) the child needs the
				// emulator as much as this process did.
				name, args = emu, append([]string{os.Args[0]}, args...)
			}
			cmd := exec.Command(name, args...)
			cmd.Env = append(os.Environ(), childEnv+"="+dir, fmt.Sprintf("%s_RO=%d", childEnv, map[bool]int{false: 0, true: 1}[ro]))
			out, err := cmd.CombinedOutput()
			var ee *exec.Error
			if errors.As(err, &ee) || errors.Is(err, syscall.ENOEXEC) {
				t.Skipf("cannot run the test binary as a child: %v (under an emulator, name it in %s)", err, execEnv)
			}
			result := regexp.MustCompile(`OPEN-RESULT .*`).Find(out)
			switch {
			case err != nil || result == nil:
				lines := strings.SplitN(string(out), "\n", 12)
				t.Errorf("Open of a file with a damaged page crashed the process (%v) instead of returning ErrCorrupt:\n%s",
					err, strings.Join(lines[:min(len(lines), 11)], "\n"))
			case !bytes.Contains(result, []byte("corrupt=true")):
				t.Errorf("Open of a file with a damaged page: %s, want ErrCorrupt", result)
			}
			if fileHash(t, path) != before {
				t.Error("Open wrote to a file with a damaged page")
			}
		})
	}
}

// ---------------------------------------------------------------------------
// 6. Read-only open

func TestReadOnlyOpenReadsWithoutWriting(t *testing.T) {
	dir := t.TempDir()
	want := writeLog(t, dir, 120)
	path := filepath.Join(dir, FileName)
	before := fileHash(t, path)

	db := testOpen(t, dir, &Options{ReadOnly: true})
	other := testOpen(t, dir, &Options{ReadOnly: true}) // two `tandem inspect` at once
	for _, db := range []*DB{db, other} {
		var got []pb.Entry
		if err := db.Scan(1, func(e pb.Entry) bool { got = append(got, e); return true }); err != nil {
			t.Fatal(err)
		}
		if d := diffEntries(got, want); d != "" {
			t.Errorf("Scan on a read-only open: %s", d)
		}
	}
	if hs, cs, _ := db.InitialState(); hs.Commit != 120 || !reflect.DeepEqual(cs.Voters, []uint64{1}) {
		t.Errorf("InitialState = %+v, %+v", hs, cs)
	}
	if err := db.Save(pb.HardState{Term: 1, Commit: 121}, makeEntries(121, 1, 1)); err == nil {
		t.Error("Save on a read-only open succeeded")
	}
	if l, _ := db.LastIndex(); l != 120 {
		t.Errorf("LastIndex after a refused Save = %d, want 120", l)
	}
	if err := db.SetNodeID(7); err == nil {
		t.Error("SetNodeID on a read-only open succeeded")
	}
	db.Stage(BucketSessions, "k", []byte("v"))
	db.SetApplied(5)
	mustClose(t, db)
	mustClose(t, other)
	if fileHash(t, path) != before {
		t.Error("a read-only open changed the file")
	}
}
