package mqtt

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode"

	"golang.org/x/crypto/bcrypt"
)

// MaxPasswordLen is the longest password bcrypt takes into account; longer
// ones are refused rather than silently cut.
const MaxPasswordLen = 72

// Users is a parsed users file: one "user:bcrypt-hash" per line, as
// `tandem passwd` prints them. It is immutable once loaded, so a reload
// builds a new one and swaps it in.
type Users struct {
	hashes map[string][]byte
	// dummy is compared against when the user is unknown, so an unknown
	// user costs as much time as a wrong password and the answer's timing
	// does not tell which user names exist.
	dummy []byte
}

// LoadUsers reads the users file at path. Errors name the file and line.
func LoadUsers(path string) (*Users, error) { return loadFile(path, "users file", ParseUsers) }

// ParseUsers parses a users file; name is the file name used in errors.
// Blank lines and lines starting with # are skipped. A line that is not
// "user:bcrypt-hash", or repeats a user, is an error naming name and line.
func ParseUsers(r io.Reader, name string) (*Users, error) {
	u := &Users{hashes: map[string][]byte{}}
	first := map[string]int{}
	cost := 0
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		user, hash, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("%s:%d: expected user:bcrypt-hash (tandem passwd USER prints one)", name, n)
		}
		if err := CheckUserName(user); err != nil {
			return nil, fmt.Errorf("%s:%d: %w", name, n, err)
		}
		c, err := bcrypt.Cost([]byte(hash))
		if err != nil {
			hint := ""
			if strings.HasPrefix(hash, "$6$") || strings.HasPrefix(hash, "$7$") {
				hint = " (a Mosquitto password hash cannot be converted: set the password again with tandem passwd)"
			}
			return nil, fmt.Errorf("%s:%d: user %q: not a bcrypt hash%s", name, n, user, hint)
		}
		if l, dup := first[user]; dup {
			return nil, fmt.Errorf("%s:%d: user %q repeats line %d", name, n, user, l)
		}
		first[user] = n
		u.hashes[user] = []byte(hash)
		cost = max(cost, c)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if cost == 0 {
		cost = bcrypt.DefaultCost
	}
	// The dummy costs what the dearest real hash costs, so even that
	// user's existence does not show in the timing.
	secret := make([]byte, 16)
	_, _ = rand.Read(secret)
	dummy, err := bcrypt.GenerateFromPassword(secret, cost)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	u.dummy = dummy
	return u, nil
}

// Len returns the number of users.
func (u *Users) Len() int { return len(u.hashes) }

// Check reports whether password is user's. It runs one bcrypt comparison
// whether or not the user exists, so both failures take as long.
func (u *Users) Check(user string, password []byte) bool {
	hash, known := u.hashes[user]
	if !known {
		hash = u.dummy
	}
	err := bcrypt.CompareHashAndPassword(hash, password)
	// bcrypt reads only the first 72 bytes: a longer password would match
	// on its prefix alone, and `tandem passwd` never makes one.
	return known && err == nil && len(password) <= MaxPasswordLen
}

// CheckUserName refuses user names a users file cannot hold or that would
// be confusing in an ACL file: empty, with a colon, with control
// characters or with spaces around them.
func CheckUserName(user string) error {
	switch {
	case user == "":
		return errors.New("empty user name")
	case strings.Contains(user, ":"):
		return fmt.Errorf("user name %q contains a colon", user)
	case strings.IndexFunc(user, unicode.IsControl) >= 0:
		return fmt.Errorf("user name %q contains control characters", user)
	case strings.TrimSpace(user) != user:
		return fmt.Errorf("user name %q starts or ends with a space", user)
	}
	return nil
}

// HashPassword returns the users-file line for user and password at bcrypt
// cost (0 means bcrypt's default), without a newline.
func HashPassword(user string, password []byte, cost int) (string, error) {
	if err := CheckUserName(user); err != nil {
		return "", err
	}
	if len(password) == 0 {
		return "", errors.New("empty password")
	}
	if len(password) > MaxPasswordLen {
		return "", fmt.Errorf("password longer than %d bytes (bcrypt ignores the rest)", MaxPasswordLen)
	}
	if bytes.ContainsAny(password, "\r\n") {
		return "", errors.New("password contains a line break")
	}
	if cost == 0 {
		cost = bcrypt.DefaultCost
	}
	if cost < bcrypt.MinCost || cost > bcrypt.MaxCost {
		return "", fmt.Errorf("bcrypt cost %d out of range %d..%d", cost, bcrypt.MinCost, bcrypt.MaxCost)
	}
	h, err := bcrypt.GenerateFromPassword(password, cost)
	if err != nil {
		return "", err
	}
	return user + ":" + string(h), nil
}
