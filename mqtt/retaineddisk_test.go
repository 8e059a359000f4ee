package mqtt

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"path/filepath"
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

				bdb, err := bolt.Open(filepath.Join(t.TempDir(), "pages.db"), 0o600, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer bdb.Close()
				log.store.mu.Lock()
				vals := make([][]byte, len(kept))
				for i, topic := range kept {
					vals[i] = log.store.m[keyRetained+topic]
				}
				log.store.mu.Unlock()
				for from := 0; from < len(kept); from += 50 {
					err := bdb.Update(func(tx *bolt.Tx) error {
						b, err := tx.CreateBucketIfNotExists([]byte("sessions"))
						if err != nil {
							return err
						}
						for i := from; i < min(from+50, len(kept)); i++ {
							if vals[i] == nil {
								return fmt.Errorf("%s: not in the store", kept[i])
							}
							if err := b.Put([]byte(keyRetained+kept[i]), vals[i]); err != nil {
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
				pages := int64(st.LeafAlloc + st.BranchAlloc)
				t.Logf("%d of %d retained messages taken: %d bytes counted (cap %d), %d bytes of pages (%d per message, %d bytes of values)",
					len(kept), n, counted, capBytes, pages, pages/int64(len(kept)), len(vals[0]))
				if pages > counted {
					t.Errorf("the retained messages take %d bytes of pages in the data file, more than the %d counted against max_retained_bytes", pages, counted)
				}
			})
		}
	}
}
