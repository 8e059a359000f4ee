package storage

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// repairedEntries runs Repair from src into a new dir and returns the new
// log and the report.
func repairedEntries(t *testing.T, src string) ([]pb.Entry, *RepairReport) {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "new")
	rep, err := Repair(src, dst, &RepairOptions{NodeID: 1})
	if err != nil {
		t.Fatalf("Repair: %v", err)
	}
	db := testOpen(t, dst, &Options{ReadOnly: true})
	defer mustClose(t, db)
	last, _ := db.LastIndex()
	got, err := db.Entries(1, last+1, math.MaxUint64)
	if err != nil {
		t.Fatal(err)
	}
	return got, rep
}

// zeroPage overwrites page id of the data file with zeros.
func zeroPage(t *testing.T, path string, id uint64, pageSize int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(make([]byte, pageSize), int64(id)*pageSize); err != nil {
		t.Fatal(err)
	}
}

// tearMetaPages zeroes both meta pages of the data file at path: bbolt
// cannot open it at all.
func tearMetaPages(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ps := int64(binary.LittleEndian.Uint32(b[16+8:]))
	zeroPage(t, path, 0, ps)
	zeroPage(t, path, 1, ps)
}

func TestRepairKeepsEveryReadableEntry(t *testing.T) {
	const n = 400
	cases := []struct {
		name   string
		damage func(t *testing.T, dir string)
		lost   []LostRange
	}{
		{"entry fails its CRC", func(t *testing.T, dir string) {
			boltUpdate(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error { return flipLastByte(tx, 137) })
		}, []LostRange{{137, 137}}},
		{"root pages of both commits gone: page by page", func(t *testing.T, dir string) {
			path := filepath.Join(dir, FileName)
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			ps := int64(binary.LittleEndian.Uint32(b[16+8:]))
			for m := range int64(2) {
				zeroPage(t, path, binary.LittleEndian.Uint64(b[m*ps+16+16:]), ps) // meta.root.root
			}
		}, nil},
		{"both meta pages torn: page by page", func(t *testing.T, dir string) {
			tearMetaPages(t, filepath.Join(dir, FileName))
		}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			want := writeLog(t, dir, n)
			tc.damage(t, dir)
			if err := Verify(dir); err == nil {
				t.Fatal("fixture: the damaged dir passes its checks")
			}
			got, rep := repairedEntries(t, dir)
			if !slices.Equal(rep.Lost, tc.lost) {
				t.Errorf("lost %v, want %v", rep.Lost, tc.lost)
			}
			if len(got) != n {
				t.Fatalf("%d entries after the repair, want %d", len(got), n)
			}
			for i := range want {
				lost := slices.ContainsFunc(tc.lost, func(l LostRange) bool { return want[i].Index >= l.From && want[i].Index <= l.To })
				switch {
				case lost && len(got[i].Data) != 0:
					t.Errorf("lost index %d holds %q, want an empty entry", got[i].Index, got[i].Data)
				case !lost && diffEntries(got[i:i+1], want[i:i+1]) != "":
					t.Errorf("index %d: %s", want[i].Index, diffEntries(got[i:i+1], want[i:i+1]))
				}
			}
		})
	}
}

// A page damaged in the middle of the log: what is before it and after it
// is copied, the entries on it are named.
func TestRepairReadsPastADamagedLeaf(t *testing.T) {
	dir := t.TempDir()
	want := writeLog(t, dir, 400)
	path := filepath.Join(dir, FileName)
	var ps int64
	var first uint64 // a run's first index, in the middle of the log
	boltView(t, path, func(tx *bolt.Tx) error {
		ps = int64(tx.DB().Info().PageSize)
		c := tx.Bucket(bucketLog).Cursor()
		k, _ := c.Seek(u64(200))
		first = binary.BigEndian.Uint64(k)
		return nil
	})
	// Every leaf page holding first's key (the live one, and stale
	// copies), found by its key in the raw pages, zeroed.
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	zeroed := 0
	for id := int64(2); id*ps < int64(len(b)); id++ {
		p := b[id*ps:]
		if binary.LittleEndian.Uint16(p[8:]) != boltLeafFlag {
			continue
		}
		for i := int64(0); i < int64(binary.LittleEndian.Uint16(p[10:])); i++ {
			e := 16 + i*16
			pos, ks := int64(binary.LittleEndian.Uint32(p[e+4:])), binary.LittleEndian.Uint32(p[e+8:])
			if k := p[e+pos:]; ks == 9 && binary.BigEndian.Uint64(k) == first && k[8] == runTag {
				zeroPage(t, path, uint64(id), ps)
				zeroed++
				break
			}
		}
	}
	if zeroed == 0 {
		t.Fatal("fixture: no leaf page holds the key")
	}
	got, rep := repairedEntries(t, dir)
	if len(rep.Lost) != 1 || rep.Lost[0].From > first || rep.Lost[0].To < first || rep.Lost[0].From < 150 || rep.Lost[0].To > 260 {
		t.Fatalf("lost %v, want one range holding %d (the damaged leaf's first entry)", rep.Lost, first)
	}
	l := rep.Lost[0]
	t.Logf("lost %v of the damaged leaf holding %d; the report says %v", l, first, rep.Unreadable)
	for i := range want {
		idx := want[i].Index
		if idx >= l.From && idx <= l.To {
			continue
		}
		if d := diffEntries(got[i:i+1], want[i:i+1]); d != "" {
			t.Errorf("index %d: %s", idx, d)
		}
	}
}

// A WAL frame damaged with good ones after it (Open refuses): the frames
// before and after it are replayed, the entries it held named lost, and
// the WAL's metadata kept.
func TestRepairReadsPastADamagedWALFrame(t *testing.T) {
	db := testOpen(t, t.TempDir(), nil)
	wal := WALName + []string{".0", ".1"}[db.wal.cur]
	want := makeEntries(1, 12, 1)
	var offs []int64
	for i := 0; i < 12; i += 4 {
		offs = append(offs, db.wal.off)
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: uint64(i)}, want[i:i+4])
	}
	db.Stage(BucketSessions, "client/a", []byte("session"))
	db.SetCommit(pb.HardState{Term: 1, Vote: 1, Commit: 12})
	if err := db.Flush(); err != nil {
		t.Fatal(err)
	}
	dir := crashCopy(t, db)
	xorByte(t, filepath.Join(dir, wal), offs[1]+walHdr+30, 0x55) // inside the second frame
	if err := Verify(dir); err == nil {
		t.Fatal("fixture: the damaged dir passes its checks")
	}
	got, rep := repairedEntries(t, dir)
	if !slices.Equal(rep.Lost, []LostRange{{5, 8}}) {
		t.Errorf("lost %v, want index 5 to 8 (the damaged frame's)", rep.Lost)
	}
	if len(got) != 12 || diffEntries(got[:4], want[:4]) != "" || diffEntries(got[8:], want[8:]) != "" {
		t.Errorf("entries after the repair: %s", briefEntries(got))
	}
	if rep.Keys[BucketSessions] != 1 {
		t.Errorf("session keys copied: %d, want the WAL's 1", rep.Keys[BucketSessions])
	}
}
