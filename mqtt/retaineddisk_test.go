package mqtt

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	bolt "go.etcd.io/bbolt"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// TestRetainedBytesCoverTheirPagesInTheDataFile (issue #32): a client that
// fills max_retained_bytes with retained messages of one size, in topic
// order or in a random one, cannot make their records take more of the
// data file than the cap. The records the server stored are written into
// a bbolt bucket as the storage layer writes them (one Put each, in the
// order they were applied, a commit per 50, bbolt's defaults), and the
// bucket's leaf and branch pages are measured. Counting the records'
// bytes, as before, they took up to twice the cap (payloads of 1,000
// bytes in topic order: 2,080 bytes of pages for 1,739 counted).
func TestRetainedBytesCoverTheirPagesInTheDataFile(t *testing.T) {
	const capBytes = 512 << 10
	for _, size := range []int{40, 300, 1000, 1250, 1450, 2300, 5000} {
		for _, shuffled := range []bool{false, true} {
			name := fmt.Sprintf("payload %d, topic order", size)
			if shuffled {
				name = fmt.Sprintf("payload %d, random order", size)
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				s, log := testServer(t, nil, func(c *Config) {
					c.Limits.MaxRetainedBytes = capBytes
					c.Limits.MaxRetained = 1 << 20
				})
				pub := connected(t, s, 5, "retainer")
				// More topics than the cap can hold, so the publishes
				// end refused; shuffled, the cap is reached across the
				// whole key range.
				n := 2*capBytes/(size+200) + 10
				order := make([]int, n)
				for i := range order {
					order[i] = i
				}
				if shuffled {
					rng := rand.New(rand.NewPCG(uint64(size), 1))
					rng.Shuffle(n, func(i, j int) { order[i], order[j] = order[j], order[i] })
				}
				var kept []string
				for i, j := range order {
					topic := fmt.Sprintf("site/%05d/state", j)
					switch code := retainedPub(t, pub, topic, uint16(i%60000+1), bytes.Repeat([]byte{'a' + byte(j%26)}, size)); code {
					case 0:
						kept = append(kept, topic)
					case packets.ErrQuotaExceeded.Code:
					default:
						t.Fatalf("%s: PUBACK %#x", topic, code)
					}
				}
				if len(kept) == n {
					t.Fatalf("all %d retained messages of %d bytes were taken under a cap of %d", n, size, capBytes)
				}
				testutil.WaitFor(t, 5*time.Second, "the log applied", func() bool { return s.applied.Load() == log.lastIndex() })
				counted := s.RetainedBytes()

				log.store.mu.Lock()
				keys := make([]string, len(kept))
				for i, topic := range kept {
					keys[i] = keyRetained + topic
				}
				pages, vals := storedPages(t, log.store.m, keys)
				log.store.mu.Unlock()
				t.Logf("%d of %d retained messages taken: %d bytes counted (cap %d), %d bytes of pages (%d per message, %d bytes of values)",
					len(kept), n, counted, capBytes, pages, pages/int64(len(kept)), vals/len(kept))
				if pages > counted {
					t.Errorf("the retained messages take %d bytes of pages in the data file, more than the %d counted against max_retained_bytes", pages, counted)
				}
			})
		}
	}
}

// storedPages writes the values of keys in m into a bbolt bucket as the
// storage layer writes the session store's (one Put each, in that order,
// a commit per 50, bbolt's defaults) and returns the bytes of its leaf
// and branch pages, and of the values.
func storedPages(t *testing.T, m map[string][]byte, keys []string) (pages int64, vals int) {
	t.Helper()
	bdb, err := bolt.Open(filepath.Join(t.TempDir(), "pages.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bdb.Close()
	for from := 0; from < len(keys); from += 50 {
		err := bdb.Update(func(tx *bolt.Tx) error {
			b, err := tx.CreateBucketIfNotExists([]byte("sessions"))
			if err != nil {
				return err
			}
			for _, k := range keys[from:min(from+50, len(keys))] {
				v, ok := m[k]
				if !ok {
					return fmt.Errorf("%q: not in the store", k)
				}
				vals += len(v)
				if err := b.Put([]byte(k), v); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	var st bolt.BucketStats
	_ = bdb.View(func(tx *bolt.Tx) error { st = tx.Bucket([]byte("sessions")).Stats(); return nil })
	return int64(st.LeafAlloc + st.BranchAlloc), vals
}

// TestSessionBytesCoverTheirPagesInTheDataFile (issue #32): persistent
// sessions that subscribe to filters of one length until max_session_bytes
// refuses them cannot make their records (session, cursor, subscriptions)
// take more of the data file than the cap; measured as for retained
// messages (storedPages), in the order the records were staged.
func TestSessionBytesCoverTheirPagesInTheDataFile(t *testing.T) {
	const capBytes = 256 << 10
	for _, flen := range []int{8, 120, 900} {
		t.Run(fmt.Sprintf("filters of %d bytes", flen), func(t *testing.T) {
			t.Parallel()
			s, log := testServer(t, nil, func(c *Config) {
				c.Limits.MaxSessionBytes = capBytes
				c.Limits.MaxSessions = 1 << 20
				c.Limits.MaxFiltersPerSession = 50
			})
			var keys []string
			full := false
			for c := 0; !full; c++ {
				id := fmt.Sprintf("dev-%04d", c)
				r, ack := persistentConnect(t, s.Addr(), 5, id)
				if ack.ReasonCode != 0 {
					break // max_session_bytes: no room for one more
				}
				keys = append(keys, sessKey(id))
				var subs []packets.Subscription
				for f := range 50 {
					filter := fmt.Sprintf("f/%03d/", f)
					filter += strings.Repeat("x", max(0, flen-len(filter)))
					subs = append(subs, packets.Subscription{Filter: filter, Qos: 1})
				}
				for i, code := range r.subscribe(1, subs...).ReasonCodes {
					if code > 2 {
						full = true
						continue
					}
					keys = append(keys, subKey(id, subs[i].Filter))
				}
				r.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
			}
			testutil.WaitFor(t, 5*time.Second, "the session records stored", func() bool {
				log.store.mu.Lock()
				defer log.store.mu.Unlock()
				for _, k := range keys {
					if log.store.m[k] == nil {
						return false
					}
				}
				return true
			})
			counted := s.SessionBytes()
			log.store.mu.Lock()
			// A cursor is stored once it moved.
			for _, k := range slices.Clone(keys) {
				if id, ok := strings.CutPrefix(k, keySession); ok && log.store.m[cursorKey(id)] != nil {
					keys = append(keys, cursorKey(id))
				}
			}
			pages, vals := storedPages(t, log.store.m, keys)
			log.store.mu.Unlock()
			t.Logf("%d records: %d bytes counted (cap %d), %d bytes of pages, %d bytes of values", len(keys), counted, capBytes, pages, vals)
			if pages > counted {
				t.Errorf("the persistent sessions take %d bytes of pages in the data file, more than the %d counted against max_session_bytes", pages, counted)
			}
		})
	}
}
