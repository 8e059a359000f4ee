package daemon

import (
	"bytes"
	"io"
	"testing"
)

// CLIMain is cli.Main. The tests here drive gateways through the command
// line as a user would, but daemon may not import cli (cli imports daemon):
// clilink_test.go, in package daemon_test, which may, sets it.
var CLIMain func(args []string, stdout, stderr io.Writer) int

// The command line's exit codes (ExitOK and so on): the contract.
const (
	ExitOK      = 0
	ExitFailure = 1
	ExitUsage   = 2
)

// ChildEnv, set to 1, makes the test binary run the CLI instead of the
// tests (clilink_test.go), so that a test can run `tandem` as a process:
// the SIGHUP test.
const ChildEnv = "TANDEM_SECURITY_TEST_CHILD"

// runMain runs `tandem args...` in this process.
func runMain(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	if CLIMain == nil {
		t.Fatal("CLIMain not set: clilink_test.go links the command line in")
	}
	var out, errb bytes.Buffer
	code := CLIMain(args, &out, &errb)
	return code, out.String(), errb.String()
}

// inspectLine is what the tests read of a line of `tandem inspect`
// (cli.InspectRecord): the JSON names of the contract.
type inspectLine struct {
	Index           uint64 `json:"index"`
	Topic           string `json:"topic,omitempty"`
	Payload         string `json:"payload"`
	PayloadEncoding string `json:"payload_encoding,omitempty"`
}
