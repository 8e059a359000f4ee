package cli

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// packaging/tandem.1 is what `tandem man` generates from the commands:
// a command or flag added without `make man` fails here.
func TestManPageIsGeneratedFromTheCommands(t *testing.T) {
	var got bytes.Buffer
	if err := writeManPage(&got, newRoot(nil, nil)); err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile("../packaging/tandem.1")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), want) {
		t.Errorf("packaging/tandem.1 is not what the commands give: run `make man` and commit it")
	}
	page := got.String()
	for _, c := range []string{"status", "cluster invite", "cluster join", "cluster remove", "promote", "pair open", "pair join", "bench", "inspect", "peers"} {
		if !strings.Contains(page, `.SS "tandem `+strings.ReplaceAll(c, "-", `\-`)) {
			t.Errorf("the man page has no section for tandem %s", c)
		}
	}
	if strings.Contains(page, `.SS "tandem man"`) {
		t.Error("the hidden man command is in the man page")
	}
	// man's own check, where it is installed (it is wherever the
	// package is built: lintian runs the same).
	if _, err := exec.LookPath("man"); err == nil {
		cmd := exec.Command("man", "--warnings", "-E", "UTF-8", "-l", "-")
		cmd.Stdin = strings.NewReader(page)
		cmd.Env = append(os.Environ(), "MANWIDTH=80", "LC_ALL=C.UTF-8")
		var stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = nil, &stderr
		if err := cmd.Run(); err != nil || stderr.Len() > 0 {
			t.Errorf("man --warnings: %v\n%s", err, stderr.String())
		}
	}
}
