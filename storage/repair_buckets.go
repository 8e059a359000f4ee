package storage

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	bolt "go.etcd.io/bbolt"
)

// Copying the broker state: every bucket but the log and the raft state.

// copyBuckets copies every bucket but the log and the raft state, key by
// key, and the meta bucket's keys Repair does not set itself. A snapshot
// being received (snapin.go) is not copied: the master sends it again.
func (s *salvager) copyBuckets() error {
	if s.bdb == nil {
		return nil
	}
	var names []string
	err := guard(func() error {
		return s.bdb.View(func(tx *bolt.Tx) error {
			return tx.ForEach(func(name []byte, _ *bolt.Bucket) error {
				switch string(name) {
				case string(bucketLog), string(bucketRaftState), string(bucketMeta), string(bucketSnapIn):
				default:
					names = append(names, string(name))
				}
				return nil
			})
		})
	})
	if err != nil && s.stateOK {
		s.rep.Unreadable = append(s.rep.Unreadable, fmt.Sprintf("the list of buckets (%v): those after %q are not copied", err, strings.Join(names, ", ")))
	}
	sort.Strings(names)
	staged := 0
	for _, name := range names {
		var lastKey []byte
		n := 0
		err := guard(func() error {
			return s.bdb.View(func(tx *bolt.Tx) error {
				return tx.Bucket([]byte(name)).ForEach(func(k, v []byte) error {
					lastKey = slices.Clone(k)
					if v == nil {
						return nil // a nested bucket: tandem writes none
					}
					s.out.Stage(name, string(k), slices.Clone(v))
					n++
					staged += len(k) + len(v)
					if staged >= 4<<20 {
						staged = 0
						return s.out.Flush()
					}
					return nil
				})
			})
		})
		s.rep.Keys[name] += n
		if err != nil && !errors.Is(err, ErrCorrupt) {
			return err
		}
		if err != nil {
			where := "any of its keys"
			if lastKey != nil {
				where = fmt.Sprintf("its keys after %q", lastKey)
			}
			s.rep.Unreadable = append(s.rep.Unreadable, fmt.Sprintf("bucket %s: %s (%v)", name, where, err))
		}
	}
	keys := make([]string, 0, len(s.meta))
	for k := range s.meta {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		s.out.Stage(string(bucketMeta), k, s.meta[k])
		s.rep.Keys[string(bucketMeta)]++
	}
	return nil
}

func appendOnce(list []string, s string) []string {
	if slices.Contains(list, s) {
		return list
	}
	return append(list, s)
}
