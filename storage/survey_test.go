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
