package mqtt

import (
	"sync"
	"time"
)

// loginBackoff slows password guessing. After a few failed logins from one
// source address, further attempts from it are refused at once, without a
// bcrypt check, for a time that doubles with each failure (at most a
// minute): a refused guess costs no CPU, so a flood of them cannot stall
// real logins. After a few failures for one user name, its logins wait for
// the name's block to end before they are checked (at most 5 s): guesses
// spread over many addresses slow down too, and the name's owner, whom
// anyone can make fail, is delayed, never locked out.
type loginBackoff struct {
	mu sync.Mutex // guards m
	m  map[string]*loginFails
}

type loginFails struct {
	n     int
	until time.Time // refused at once before then
	last  time.Time
}

// Free failures before backoff starts, and the longest block, per kind of
// key.
const (
	sourceFreeFails = 3
	sourceMaxBlock  = 60 * time.Second
	userFreeFails   = 5
	userMaxBlock    = 5 * time.Second
	maxBackoffKeys  = 1 << 16
)

// wait returns how long key's backoff has left, 0 for none.
func (b *loginBackoff) wait(key string, now time.Time) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if f := b.m[key]; f != nil && now.Before(f.until) {
		return f.until.Sub(now)
	}
	return 0
}

// failed counts a failed login for key.
func (b *loginBackoff) failed(key string, now time.Time, free int, maxBlock time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.m == nil {
		b.m = map[string]*loginFails{}
	}
	f := b.m[key]
	if f == nil {
		if len(b.m) >= maxBackoffKeys {
			b.pruneLocked(now)
		}
		f = &loginFails{}
		b.m[key] = f
	}
	f.n++
	f.last = now
	if f.n > free {
		d := time.Second << min(f.n-free-1, 10)
		f.until = now.Add(min(d, maxBlock))
	}
}

// succeeded forgets key's failures.
func (b *loginBackoff) succeeded(key string) {
	b.mu.Lock()
	delete(b.m, key)
	b.mu.Unlock()
}

// pruneLocked forgets keys idle for ten minutes, or all of them if that is
// not enough: bounded memory over a moment of leniency.
func (b *loginBackoff) pruneLocked(now time.Time) {
	for k, f := range b.m {
		if now.Sub(f.last) > 10*time.Minute {
			delete(b.m, k)
		}
	}
	if len(b.m) >= maxBackoffKeys {
		clear(b.m)
	}
}
