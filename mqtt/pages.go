package mqtt

import "unicode/utf8"

// What the broker's state takes in the data file (issue #32).
//
// Retained messages and persistent sessions are values of the session
// store's bucket, and bbolt gives a value more than its bytes: each value
// has a 16-byte element header, a 4 KiB page holds the values of a node
// written in key order only up to half a page (bbolt's split threshold,
// FillPercent 0.5), a node keeps at least two values, and a node of up to
// four values is never split, however large (pages of such a node are a
// run: a value just over half a page takes a page to itself). Measured
// (4,000 values in one bucket, commits of 50, per value in leaf and branch
// pages): 100 B values 278 B in key order, 190 B in random order; 1,000 B
// 2,080 and 1,775; 1,800 B 2,080 and 2,343; 2,100 B 4,127 and 3,180. So
// counting a record's bytes (as max_retained_bytes and max_session_bytes
// did) let the state take up to twice, three times for small records, its
// caps in the data file, and with the caps at 3/4 of the budget more than
// all of it. storedSize is what they count now.
const (
	// pageSize is the data file's page size the cost is modelled on:
	// bbolt's on the platforms gateways run (4 KiB), and a fixed one, so
	// that every member counts the same bytes for a record.
	pageSize = 4096
	// pageElem is the header bbolt gives each element of a page: a
	// value's in its leaf, and a leaf's in the branch page above it.
	pageElem = 16
)

// storedSize is the bytes of pages a value of val bytes under a key of
// key bytes takes in the data file: its share of its leaf's pages
// (pageShare), and its leaf's element in the branch page above, charged to
// each value twice: a leaf holds two values at least, branch pages are
// half full too, and a bucket's root takes a page however few leaves it
// names (63 values of 7 KB: 65 bytes of branch page each).
func storedSize(key, val int) int64 {
	k := int64(key)
	return pageShare(pageElem+k+int64(val)) + 2*(pageElem+k)
}

// pageShare is the share of pages a value whose element takes e bytes
// (header and key included) is given in the worst of the layouts bbolt
// leaves its bucket in without deletes: the nodes a commit splits off at
// the threshold (as many values as half a page holds, two at least), and
// the nodes of two, three or four values it does not split although they
// pass a page. A node of n values takes the pages its bytes need, shared
// by its values. Pages thinned by deletes (bbolt merges a page only below
// a quarter full) are not followed.
func pageShare(e int64) int64 {
	const hdr = 16 // a page's header
	nodeShare := func(n int64) int64 {
		pages := (hdr + n*e + pageSize - 1) / pageSize
		return (pages*pageSize + n - 1) / n
	}
	cost := nodeShare(max(2, (pageSize/2-hdr)/e))
	for n := int64(2); n <= 4; n++ {
		if hdr+n*e > pageSize { // one that fits a page is no worse than the split's
			cost = max(cost, nodeShare(n))
		}
	}
	return cost
}

// jsonLen is how many bytes s takes as a JSON string's contents, as
// encoding/json writes it: <, > and & and control characters escaped
// (\u003c: six bytes), quotes and backslashes (two), invalid UTF-8 as
// \ufffd.
func jsonLen(s string) int {
	n := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\' || c == '\n' || c == '\r' || c == '\t':
				n += 2
			case c < 0x20 || c == '<' || c == '>' || c == '&':
				n += 6
			default:
				n++
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			n += 6
		case r == '\u2028' || r == '\u2029':
			n += 6
		default:
			n += size
		}
		i += size
	}
	return n
}
