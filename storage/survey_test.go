package storage

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// A data file with one entry failing its CRC is read past it: the survey
// names that entry alone as unreadable and changes nothing.
func TestSurveyDamagedNamesTheBadEntry(t *testing.T) {
	dir := t.TempDir()
	writeLog(t, dir, 50)
	path := filepath.Join(dir, FileName)
	boltUpdate(t, path, func(tx *bolt.Tx) error { return flipLastByte(tx, 37) })
	before := fileHash(t, path)
	s := SurveyDamaged(dir)
	if !s.Opened || s.Last != 50 {
		t.Fatalf("survey = %+v, want the file opened up to 50", s)
	}
	if want := []IndexRange{{1, 36}, {38, 50}}; !reflect.DeepEqual(s.Readable, want) {
		t.Errorf("readable %v, want %v", s.Readable, want)
	}
	if want := []IndexRange{{37, 37}}; !reflect.DeepEqual(s.Unreadable, want) {
		t.Errorf("unreadable %v, want %v", s.Unreadable, want)
	}
	if fileHash(t, path) != before {
		t.Error("the survey changed the file")
	}
}

// A file bbolt cannot open (cut below its last transaction) is reported
// as unread, without a crash.
func TestSurveyDamagedUnopenable(t *testing.T) {
	dir := t.TempDir()
	writeLog(t, dir, 400)
	path := filepath.Join(dir, FileName)
	if err := os.Truncate(path, 8192); err != nil {
		t.Fatal(err)
	}
	s := SurveyDamaged(dir)
	if s.Opened || s.Why == "" || len(s.Readable) != 0 {
		t.Errorf("survey of a truncated file = %+v, want it unread with a reason", s)
	}
}

// What a damaged member still reads past the master's log is set aside to
// be re-published; the entry that fails its CRC is not.
func TestRequeueSalvagedSkipsTheBadEntry(t *testing.T) {
	damaged := t.TempDir()
	writeLog(t, damaged, 50)
	boltUpdate(t, filepath.Join(damaged, FileName), func(tx *bolt.Tx) error { return flipLastByte(tx, 37) })
	db := testOpen(t, t.TempDir(), nil)
	n, err := db.RequeueSalvaged(damaged, 30)
	if err != nil || n != 19 {
		t.Fatalf("RequeueSalvaged = %d, %v; want the 19 intact entries 31..50 but 37", n, err)
	}
	got, err := db.Requeued(100)
	if err != nil || len(got) != 19 {
		t.Fatalf("Requeued = %d entries, %v", len(got), err)
	}
	for _, r := range got {
		if r.Index <= 30 || r.Index == 37 {
			t.Errorf("requeued index %d", r.Index)
		}
	}
	if !db.TakeRequeueSignal() {
		t.Error("no requeue signal for replication")
	}
}
