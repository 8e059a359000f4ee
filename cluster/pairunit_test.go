package cluster

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
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

func TestPairBookLimits(t *testing.T) {
	key := []byte("key")
	macOf := func(k []byte) []byte { return PairMAC(k, PairRoleJoiner, [32]byte{}, [32]byte{}, nil, nil) }
	right, wrong := macOf(key), macOf([]byte("guess"))
	now := time.Unix(1_000_000, 0)
	var b pairBook

	if open, _ := b.state(now); open {
		t.Fatal("open before pair open")
	}
	if _, _, err := b.try("a", 7, right, macOf, now); !errors.Is(err, errPairClosed) {
		t.Fatalf("closed book: %v", err)
	}

	// Rate limit: a second attempt within a second from one address is
	// not even checked (and not counted); five wrong ones end that
	// address's attempts, not the pairing.
	b.open(key, now.Add(10*time.Minute))
	if open, exp := b.state(now); !open || !exp.Equal(now.Add(10*time.Minute)) {
		t.Fatalf("state after open: %v %v", open, exp)
	}
	if _, n, err := b.try("a", 7, wrong, macOf, now); !errors.Is(err, ErrPairWrong) || n != 1 {
		t.Fatalf("wrong code: %v (%d failures)", err, n)
	}
	if _, n, err := b.try("a", 7, right, macOf, now.Add(500*time.Millisecond)); !errors.Is(err, errPairBusy) || n != 1 {
		t.Fatalf("second attempt within a second: %v (%d failures)", err, n)
	}
	for i := 2; i <= PairMaxFailures; i++ {
		now = now.Add(pairMinInterval)
		_, n, err := b.try("a", 7, wrong, macOf, now)
		if !errors.Is(err, ErrPairWrong) || n != i {
			t.Fatalf("wrong code %d: %v (%d failures)", i, err, n)
		}
	}
	now = now.Add(pairMinInterval)
	if _, _, err := b.try("a", 7, right, macOf, now); !errors.Is(err, ErrPairLocked) {
		t.Fatalf("right code after %d failures from one address: %v, want locked", PairMaxFailures, err)
	}
	if open, _ := b.state(now); !open {
		t.Fatal("a stranger's failures closed the pairing")
	}
	if _, _, err := b.try("b", 7, wrong, macOf, now); !errors.Is(err, ErrPairWrong) {
		t.Fatalf("wrong code from another address: %v", err)
	}
	if _, _, err := b.try("c", 7, right, macOf, now); err != nil {
		t.Fatalf("right code from a third address: %v", err)
	}
	// Only so many addresses are remembered per code, and many addresses
	// crowd nobody out: the one idle longest is forgotten.
	b.open(key, now.Add(10*time.Minute))
	for i := range pairMaxSources + 10 {
		if _, _, err := b.try(fmt.Sprint("s", i), 7, wrong, macOf, now.Add(time.Duration(i)*time.Millisecond)); !errors.Is(err, ErrPairWrong) {
			t.Fatalf("source %d: %v", i, err)
		}
	}
	if n := len(b.cur.bySrc); n != pairMaxSources {
		t.Fatalf("%d sources remembered, want %d", n, pairMaxSources)
	}
	if _, ok := b.cur.bySrc["s0"]; ok {
		t.Fatal("the source idle longest was kept")
	}
	if _, _, err := b.try("late", 7, right, macOf, now); err != nil {
		t.Fatalf("a joiner after many addresses: %v", err)
	}

	// Single use: the pairing node may retry, another may not; release
	// (the node could not be added) reopens it.
	b.open(key, now.Add(time.Minute))
	p, _, err := b.try("a", 7, right, macOf, now)
	if err != nil || !bytes.Equal(p.key, key) {
		t.Fatalf("right code: %v", err)
	}
	if open, _ := b.state(now); open {
		t.Fatal("still advertised open once used")
	}
	now = now.Add(pairMinInterval)
	if _, _, err := b.try("b", 8, right, macOf, now); !errors.Is(err, errPairUsed) {
		t.Fatalf("reused by another node: %v", err)
	}
	now = now.Add(pairMinInterval)
	if _, _, err := b.try("a", 7, right, macOf, now); err != nil {
		t.Fatalf("retry by the same node: %v", err)
	}
	b.release(p)
	now = now.Add(pairMinInterval)
	if _, _, err := b.try("b", 8, right, macOf, now); err != nil {
		t.Fatalf("after release: %v", err)
	}

	// Expiry.
	b.open(key, now.Add(time.Minute))
	now = now.Add(time.Minute)
	if open, _ := b.state(now); open {
		t.Fatal("open at its expiry")
	}
	if _, _, err := b.try("a", 7, right, macOf, now); !errors.Is(err, errPairExpired) {
		t.Fatalf("expired: %v", err)
	}
}
