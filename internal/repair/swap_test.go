package repair

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// copyFiles copies every regular file of src into a new dir. A file that
// goes between the listing and its read (a live DB's next segment, renamed
// when it is made ready) is not copied, as a crash then would not find it.
func copyFiles(t *testing.T, src string) string {
	t.Helper()
	dst := t.TempDir()
	des, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range des {
		if !de.Type().IsRegular() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, de.Name()))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, de.Name()), b, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	return dst
}

// A swap cut short after any of its renames (a power cut, a full disk)
// leaves a data dir that opens with the whole log: the damaged data file
// with its own WAL, or the repaired one with its own, never the one's data
// file with the other's WAL, whose frames it would take for dead. The dir
// here holds records only in its WAL, as a gateway that was killed does.
func TestSwapCutShortLeavesOneWholeDataDir(t *testing.T) {
	live := t.TempDir()
	db, err := storage.Open(live, &storage.Options{MinFree: -1})
	if err != nil {
		t.Fatal(err)
	}
	const n = 50
	var ents []pb.Entry
	for i := uint64(1); i <= n; i++ {
		ents = append(ents, pb.Entry{Index: i, Term: 1, Data: []byte("record")})
	}
	if err := db.Save(pb.HardState{Term: 1, Vote: 1, Commit: n}, ents); err != nil {
		t.Fatal(err)
	}
	src := copyFiles(t, live) // the WAL's frames not checkpointed: a kill -9
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	repaired := t.TempDir()
	if _, err := storage.Repair(src, repaired, &storage.RepairOptions{AllowCluster: true}); err != nil {
		t.Fatal(err)
	}
	names, err := storage.Files(repaired)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { renameFile = os.Rename }()
	for cut := 0; cut <= len(names); cut++ {
		dir, tmp := copyFiles(t, src), copyFiles(t, repaired)
		renames := 0
		renameFile = func(from, to string) error {
			if renames++; renames > cut {
				return errors.New("cut short")
			}
			return os.Rename(from, to)
		}
		err := swap(dir, tmp, filepath.Join(dir, "damaged", "now"))
		if cut < len(names) && err == nil {
			t.Fatalf("swap cut short after %d renames returned no error", cut)
		}
		db, err := storage.Open(dir, &storage.Options{MinFree: -1})
		if err != nil {
			t.Fatalf("after %d of %d renames: %v", cut, len(names), err)
		}
		last, _ := db.LastIndex()
		db.Close()
		if last != n {
			t.Fatalf("after %d of %d renames the log ends at %d, want %d: a WAL taken for dead", cut, len(names), last, n)
		}
	}
}
