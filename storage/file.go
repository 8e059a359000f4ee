package storage

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"os"
)

// bbolt's on-disk meta page, as laid out by go.etcd.io/bbolt v1.5.0
// (internal/common/meta.go), little-endian on every platform we build for.
const (
	boltMagic       = 0xED0CDAED
	boltVersion     = 2
	boltPageHdrSize = 16
	boltMetaSize    = 64
	boltSumOffset   = 56
)

// boltMeta is the part of a bbolt meta page that checkFile needs.
type boltMeta struct {
	pageSize uint32
	pgid     uint64 // high-water mark: the file must hold this many pages
	txid     uint64
}

// checkFile looks at an existing data file before bbolt opens it, because
// bbolt v1.5.0 silently initialises a zero-length file as a new database and
// opens a truncated one only to die of SIGBUS later (FACTS.md). It returns
// nil for a file that does not exist yet.
func checkFile(path string) error {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	size := st.Size()
	if size == 0 {
		return fmt.Errorf("%s is empty (0 bytes): a data file is never empty, so it was damaged or created by something else; move it away to start afresh: %w", path, ErrCorrupt)
	}
	m0, err0 := readBoltMeta(f, 0)
	var m1 boltMeta
	var err1 error
	if err0 == nil {
		m1, err1 = readBoltMeta(f, int64(m0.pageSize))
	} else {
		// Meta page 0 is torn: find page 1 the way bbolt does, at the
		// offset equal to its own page size (4 KiB, 16 KiB, 64 KiB...).
		err1 = err0
		for ps := int64(1024); ps <= 1<<16 && ps < size; ps <<= 1 {
			if m, err := readBoltMeta(f, ps); err == nil && int64(m.pageSize) == ps {
				m1, err1 = m, nil
				break
			}
		}
	}
	var m boltMeta
	switch {
	case err0 != nil && err1 != nil:
		return fmt.Errorf("%s is not a tandem data file or both its meta pages are damaged (%v; %v): %w", path, err0, err1, ErrCorrupt)
	case err0 != nil:
		m = m1
	case err1 != nil:
		m = m0
	case m1.txid > m0.txid:
		m = m1
	default:
		m = m0
	}
	if need := int64(m.pgid) * int64(m.pageSize); size < need {
		return fmt.Errorf("%s is truncated: it has %d bytes, its last transaction needs %d: %w", path, size, need, ErrCorrupt)
	}
	return nil
}

// readBoltMeta reads and validates the meta page at off.
func readBoltMeta(f *os.File, off int64) (boltMeta, error) {
	var b [boltPageHdrSize + boltMetaSize]byte
	if _, err := f.ReadAt(b[:], off); err != nil {
		if err == io.EOF {
			return boltMeta{}, fmt.Errorf("meta page at %d: file too short", off)
		}
		return boltMeta{}, fmt.Errorf("meta page at %d: %w", off, err)
	}
	m := b[boltPageHdrSize:]
	le := binary.LittleEndian
	if le.Uint32(m[0:]) != boltMagic {
		return boltMeta{}, fmt.Errorf("meta page at %d: bad magic", off)
	}
	if v := le.Uint32(m[4:]); v != boltVersion {
		return boltMeta{}, fmt.Errorf("meta page at %d: bbolt version %d", off, v)
	}
	h := fnv.New64a()
	h.Write(m[:boltSumOffset])
	if h.Sum64() != le.Uint64(m[boltSumOffset:]) {
		return boltMeta{}, fmt.Errorf("meta page at %d: checksum mismatch", off)
	}
	ps := le.Uint32(m[8:])
	if ps < 1024 || ps&(ps-1) != 0 {
		return boltMeta{}, fmt.Errorf("meta page at %d: page size %d", off, ps)
	}
	return boltMeta{pageSize: ps, pgid: le.Uint64(m[40:]), txid: le.Uint64(m[48:])}, nil
}
