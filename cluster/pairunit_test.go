package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/replication"
)

func TestPairCodeFormat(t *testing.T) {
	if bits := float64(pairCodeLen) * math.Log2(float64(len(pairAlphabet))); bits < 60 {
		t.Fatalf("a code carries %.0f bits, want at least 60", bits)
	}
	counts := map[rune]int{}
	seen := map[string]bool{}
	for range 2000 {
		code, err := newPairCode()
		if err != nil {
			t.Fatal(err)
		}
		if len(code) != 14 || code[4] != '-' || code[9] != '-' {
			t.Fatalf("code %q is not grouped XXXX-XXXX-XXXX", code)
		}
		canon, err := ParsePairCode(code)
		if err != nil || formatPairCode(canon) != code {
			t.Fatalf("code %q does not parse back: %q %v", code, canon, err)
		}
		for _, r := range canon {
			if strings.ContainsRune("ILOU", r) {
				t.Fatalf("code %q holds a confusable letter", code)
			}
			counts[r]++
		}
		if seen[code] {
			t.Fatalf("code %q drawn twice", code)
		}
		seen[code] = true
	}
	// 24000 symbols over 32: each about 750; a broken draw shows at once.
	if len(counts) != 32 {
		t.Fatalf("%d symbols used, want all 32", len(counts))
	}
	for r, n := range counts {
		if n < 500 || n > 1000 {
			t.Fatalf("symbol %c drawn %d times of 24000: biased", r, n)
		}
	}
}

func TestParsePairCode(t *testing.T) {
	for _, in := range []string{"7KQF-M2XA-9RTD", "7kqf-m2xa-9rtd", "7KQFM2XA9RTD", " 7KQF M2XA 9RTD ", "7kqF-m2Xa-9RTd"} {
		if got, err := ParsePairCode(in); err != nil || got != "7KQFM2XA9RTD" {
			t.Errorf("parse %q: %q %v", in, got, err)
		}
	}
	// Confusables read as the digit they look like.
	for in, want := range map[string]string{"O0O0-IiLl-1111": "000011111111", "oooo-AAAA-BBBB": "0000AAAABBBB"} {
		if got, err := ParsePairCode(in); err != nil || got != want {
			t.Errorf("parse %q: %q %v, want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "7KQF-M2XA-9RT", "7KQF-M2XA-9RTDX", "7KQF-M2XA-9RTU", "7KQF-M2XA-9RT!", "7KQF-M2XA-9RTÉ", "tandem1.abcdef"} {
		if got, err := ParsePairCode(bad); err == nil {
			t.Errorf("parse %q accepted as %q", bad, got)
		}
	}
}

func TestPairKey(t *testing.T) {
	saved := PairKDFCost
	PairKDFCost = 1 << 15
	defer func() { PairKDFCost = saved }()
	start := time.Now()
	k1 := PairKey("7KQFM2XA9RTD")
	took := time.Since(start)
	if len(k1) != 32 || bytes.Equal(k1, PairKey("7KQFM2XA9RTE")) || !bytes.Equal(k1, PairKey("7KQFM2XA9RTD")) {
		t.Fatal("pairKey is not a 32-byte function of the code")
	}
	t.Logf("key derivation at the real cost: %v", took)
}

func TestPairMACBinding(t *testing.T) {
	key := PairKey("7KQFM2XA9RTD")
	fpJ, fpM := [32]byte{1}, [32]byte{2}
	bind := bytes.Repeat([]byte{3}, 32)
	good := PairMAC(key, PairRoleJoiner, fpJ, fpM, bind, nil)
	if !bytes.Equal(good, PairMAC(key, PairRoleJoiner, fpJ, fpM, bind, nil)) {
		t.Fatal("MAC not deterministic")
	}
	other := bytes.Repeat([]byte{4}, 32)
	for name, mac := range map[string][]byte{
		"another code":         PairMAC(PairKey("7KQFM2XA9RTE"), PairRoleJoiner, fpJ, fpM, bind, nil),
		"the other role":       PairMAC(key, pairRoleMaster, fpJ, fpM, bind, nil),
		"another joiner":       PairMAC(key, PairRoleJoiner, [32]byte{9}, fpM, bind, nil),
		"another master":       PairMAC(key, PairRoleJoiner, fpJ, [32]byte{9}, bind, nil),
		"fingerprints swapped": PairMAC(key, PairRoleJoiner, fpM, fpJ, bind, nil),
		"another connection":   PairMAC(key, PairRoleJoiner, fpJ, fpM, other, nil),
		"another reply":        PairMAC(key, PairRoleJoiner, fpJ, fpM, bind, []byte("x")),
	} {
		if bytes.Equal(mac, good) {
			t.Errorf("%s gives the same MAC", name)
		}
	}
}

// pairTestMAC is the MAC a guess of key sends in the book's unit tests.
func pairTestMAC(k []byte) []byte {
	return PairMAC(k, PairRoleJoiner, [32]byte{}, [32]byte{}, nil, nil)
}

func TestPairBookSingleUseAndExpiry(t *testing.T) {
	key := []byte("key")
	right := pairTestMAC(key)
	now := time.Unix(1_000_000, 0)
	var b pairBook

	if open, _ := b.state(now); open {
		t.Fatal("open before pair open")
	}
	if _, _, err := b.try(7, right, pairTestMAC, now); !errors.Is(err, errPairClosed) {
		t.Fatalf("closed book: %v", err)
	}
	// Single use: the pairing node may retry, another may not; release
	// (the node could not be added) reopens it.
	b.open(key, now.Add(time.Minute))
	if open, exp := b.state(now); !open || !exp.Equal(now.Add(time.Minute)) {
		t.Fatalf("state after open: %v %v", open, exp)
	}
	p, _, err := b.try(7, right, pairTestMAC, now)
	if err != nil || !bytes.Equal(p.key, key) {
		t.Fatalf("right code: %v", err)
	}
	if open, _ := b.state(now); open {
		t.Fatal("still advertised open once used")
	}
	if _, _, err := b.try(8, right, pairTestMAC, now); !errors.Is(err, errPairUsed) {
		t.Fatalf("reused by another node: %v", err)
	}
	if _, _, err := b.try(7, right, pairTestMAC, now); err != nil {
		t.Fatalf("retry by the same node: %v", err)
	}
	b.release(p)
	if _, _, err := b.try(8, right, pairTestMAC, now); err != nil {
		t.Fatalf("after release: %v", err)
	}

	// Expiry.
	b.open(key, now.Add(time.Minute))
	now = now.Add(time.Minute)
	if open, _ := b.state(now); open {
		t.Fatal("open at its expiry")
	}
	if _, _, err := b.try(7, right, pairTestMAC, now); !errors.Is(err, errPairExpired) {
		t.Fatalf("expired: %v", err)
	}
}

// TestPairingGuessesAreCappedGlobally: forty source addresses guessing in
// parallel, ten times a second each, get the checks one address would:
// the burst at once, then one a second. The guesses over the cap are
// refused unchecked and are not wrong codes, so they close nothing.
func TestPairingGuessesAreCappedGlobally(t *testing.T) {
	key := []byte("key")
	start := time.Unix(1_000_000, 0)
	var mu sync.Mutex
	now := start
	b := pairBook{clock: func() time.Time { mu.Lock(); defer mu.Unlock(); return now }}
	b.open(key, start.Add(10*time.Minute))
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	var wrong, overCap atomic.Int64
	wrongAt := map[int]time.Duration{} // the n-th wrong code, by its time since the start
	for tick := 0; tick < 50 && len(wrongAt) < PairMaxFailures; tick++ {
		at := time.Duration(tick) * 100 * time.Millisecond
		mu.Lock()
		now = start.Add(at)
		mu.Unlock()
		var wg sync.WaitGroup
		for i := range 40 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := replication.Remote{ID: uint64(100 + i), Addr: fmt.Sprintf("127.0.0.%d:40000", i+2)}
				_, err := b.check(context.Background(), log, r, "guesser", pairTestMAC([]byte(fmt.Sprint("guess", i, tick))), pairTestMAC)
				switch {
				case errors.Is(err, errPairBusy):
					overCap.Add(1)
				case errors.Is(err, ErrPairWrong):
					wrong.Add(1)
				case errors.Is(err, ErrPairLocked):
					// In the tick the fifth wrong code closed it
					// (that the fifth came no sooner is checked below).
				default:
					t.Errorf("guess from 127.0.0.%d at %v: %v", i+2, at, err)
				}
			}()
		}
		wg.Wait()
		for n := len(wrongAt) + 1; n <= int(wrong.Load()); n++ {
			wrongAt[n] = at
		}
	}
	// Within the first second: the burst and no more, from 400 guesses.
	if wrongAt[pairGuessBurst] != 0 || wrongAt[pairGuessBurst+1] < pairGuessEvery {
		t.Fatalf("checked guesses at %v: the burst of %d at once, the next a second later expected", wrongAt, pairGuessBurst)
	}
	for n := pairGuessBurst + 1; n <= PairMaxFailures; n++ {
		if want := time.Duration(n-pairGuessBurst) * pairGuessEvery; wrongAt[n] < want || n > len(wrongAt) {
			t.Fatalf("wrong code %d checked at %v, before %v: checked guesses %v", n, wrongAt[n], want, wrongAt)
		}
	}
	if wrong.Load() != PairMaxFailures || overCap.Load() < 400 {
		t.Fatalf("%d checked, %d refused over the cap", wrong.Load(), overCap.Load())
	}
	got := b.counts()
	if got[pairWrong] != PairMaxFailures || got[pairOverCap] != uint64(overCap.Load()) || got[pairRight] != 0 {
		t.Fatalf("counted outcomes %v: want %d wrong, %d over the cap", got, PairMaxFailures, overCap.Load())
	}
}

// TestPairingClosesAfterFiveWrongCodes: five wrong codes in total, from
// any addresses, close the pairing with a log line saying so; the right
// code is refused from then on until a new pair open, which starts afresh.
// Guesses refused over the cap in between are no wrong codes.
func TestPairingClosesAfterFiveWrongCodes(t *testing.T) {
	key := []byte("key")
	right, wrong := pairTestMAC(key), pairTestMAC([]byte("guess"))
	now := time.Unix(1_000_000, 0)
	b := pairBook{clock: func() time.Time { return now }}
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	from := func(i int) replication.Remote {
		return replication.Remote{ID: uint64(100 + i), Addr: fmt.Sprintf("127.0.0.%d:40000", i+2)}
	}

	b.open(key, now.Add(10*time.Minute))
	// Ten guesses at once from ten addresses: the burst is checked, the
	// rest is refused over the cap and counts for nothing.
	var busy int
	for i := range 10 {
		_, err := b.check(context.Background(), log, from(i), "guesser", wrong, pairTestMAC)
		switch {
		case errors.Is(err, errPairBusy):
			busy++
		case !errors.Is(err, ErrPairWrong):
			t.Fatalf("guess %d: %v", i+1, err)
		}
	}
	if busy != 10-pairGuessBurst || b.cur.failures != pairGuessBurst {
		t.Fatalf("%d refused over the cap, %d wrong codes counted; want %d and %d", busy, b.cur.failures, 10-pairGuessBurst, pairGuessBurst)
	}
	for n := pairGuessBurst + 1; n <= PairMaxFailures; n++ {
		if open, _ := b.state(now); !open {
			t.Fatalf("closed after %d wrong codes", n-1)
		}
		now = now.Add(pairGuessEvery)
		if _, err := b.check(context.Background(), log, from(n), "guesser", wrong, pairTestMAC); !errors.Is(err, ErrPairWrong) {
			t.Fatalf("wrong code %d: %v", n, err)
		}
	}
	if open, _ := b.state(now); open {
		t.Fatal("still open after five wrong codes")
	}
	if !strings.Contains(logs.String(), "pairing closed: too many wrong codes") || !strings.Contains(logs.String(), "127.0.0.") {
		t.Fatalf("the closing was not logged with the address:\n%s", logs.String())
	}
	_, err := b.check(context.Background(), log, from(9), "joiner", right, pairTestMAC)
	if !errors.Is(err, ErrPairLocked) || !strings.Contains(err.Error(), "tandem pair open") {
		t.Fatalf("the right code once closed: %v, want %v", err, ErrPairLocked)
	}
	// pair open again: a fresh code with a fresh count.
	b.open(key, now.Add(10*time.Minute))
	if _, err := b.check(context.Background(), log, from(0), "guesser", wrong, pairTestMAC); !errors.Is(err, ErrPairWrong) {
		t.Fatalf("wrong code after a new open: %v", err)
	}
	if _, err := b.check(context.Background(), log, from(9), "joiner", right, pairTestMAC); err != nil {
		t.Fatalf("the right code after a new open: %v", err)
	}
}
