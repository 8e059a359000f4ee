package daemon_test

import (
	"os"

	"github.com/tandem-edge/tandem/cli"
	"github.com/tandem-edge/tandem/daemon"
)

// The command line, linked into the daemon's tests (see CLIMain). With
// ChildEnv set, the test binary doubles as `tandem`: it runs the CLI
// instead of the tests.
func init() {
	daemon.CLIMain = cli.Main
	if os.Getenv(daemon.ChildEnv) == "1" {
		os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
	}
}
