package cli

import (
	"bytes"
	"testing"
)

// runMain runs `tandem args...` in this process.
func runMain(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := Main(args, &out, &errb)
	return code, out.String(), errb.String()
}
