package mqtt

import (
	"strings"
	"testing"

	"golang.org/x/crypto/bcrypt"
)

func hashLine(t *testing.T, user, pw string) string {
	t.Helper()
	line, err := HashPassword(user, []byte(pw), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	return line
}

func TestUsersCheck(t *testing.T) {
	in := "# gateway users\n\n" + hashLine(t, "alice", "s3cret") + "\n  " + hashLine(t, "bob", "pw") + "  \r\n"
	u, err := ParseUsers(strings.NewReader(in), "users")
	if err != nil {
		t.Fatal(err)
	}
	if u.Len() != 2 {
		t.Fatalf("%d users, want 2", u.Len())
	}
	for _, tt := range []struct {
		user, pw string
		want     bool
	}{
		{"alice", "s3cret", true},
		{"bob", "pw", true},
		{"alice", "pw", false},
		{"alice", "", false},
		{"carol", "s3cret", false},
		{"", "", false},
	} {
		if got := u.Check(tt.user, []byte(tt.pw)); got != tt.want {
			t.Errorf("Check(%q, %q) = %v, want %v", tt.user, tt.pw, got, tt.want)
		}
	}
	if c, _ := bcrypt.Cost(u.dummy); c != bcrypt.MinCost {
		t.Errorf("dummy hash cost %d, want the file's %d so unknown users take as long", c, bcrypt.MinCost)
	}
}

func TestUsersParseErrorsNameTheLine(t *testing.T) {
	good := hashLine(t, "a", "x")
	for _, tt := range []struct{ in, want string }{
		{"alice\n", "users:1: expected user:bcrypt-hash"},
		{good + "\nbob:plain\n", "users:2: user \"bob\": not a bcrypt hash"},
		{"bob:$7$101$abc\n", "Mosquitto password hash"},
		{good + "\n" + good + "\n", "users:2: user \"a\" repeats line 1"},
		{":" + strings.SplitN(good, ":", 2)[1] + "\n", "users:1: empty user name"},
	} {
		_, err := ParseUsers(strings.NewReader(tt.in), "users")
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want %q", tt.in, err, tt.want)
		}
	}
}

func TestHashPasswordRefusesWhatCannotWork(t *testing.T) {
	for _, tt := range []struct{ user, pw string }{
		{"a:b", "x"}, {"", "x"}, {" a", "x"}, {"a", ""}, {"a", strings.Repeat("x", 73)}, {"a", "x\ny"},
	} {
		if _, err := HashPassword(tt.user, []byte(tt.pw), bcrypt.MinCost); err == nil {
			t.Errorf("HashPassword(%q, %q) succeeded", tt.user, tt.pw)
		}
	}
}
