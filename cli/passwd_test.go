package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/tandem-edge/tandem/mqtt"
)

func TestPasswdPrintsAUsersFileLine(t *testing.T) {
	run := func(stdin string, args ...string) (string, error) {
		cmd := newPasswdCmd()
		var out, errb bytes.Buffer
		cmd.SetIn(strings.NewReader(stdin))
		cmd.SetOut(&out)
		cmd.SetErr(&errb)
		cmd.SetArgs(args)
		err := cmd.Execute()
		return out.String(), err
	}
	line, err := run("s3cret\n", "sensor-12", "--cost", "4")
	if err != nil {
		t.Fatal(err)
	}
	u, err := mqtt.ParseUsers(strings.NewReader(line), "stdout")
	if err != nil {
		t.Fatalf("%q: %v", line, err)
	}
	if !u.Check("sensor-12", []byte("s3cret")) || u.Check("sensor-12", []byte("s3cret\n")) {
		t.Fatalf("the printed line %q does not check the password", line)
	}
	if !strings.HasPrefix(line, "sensor-12:$2a$04$") {
		t.Fatalf("line %q: want user:bcrypt-hash at cost 4", line)
	}
	for _, tt := range []struct {
		stdin string
		args  []string
	}{
		{"x\n", []string{"a:b"}},
		{"", []string{"alice"}},
		{"\n", []string{"alice"}},
		{strings.Repeat("x", 73) + "\n", []string{"alice"}},
		{"x\n", []string{"alice", "--cost", "99"}},
	} {
		if out, err := run(tt.stdin, tt.args...); err == nil {
			t.Errorf("passwd %v with %q on stdin printed %q", tt.args, tt.stdin, out)
		}
	}
}
