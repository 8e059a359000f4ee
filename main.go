// Command tandem is a durable, replicated MQTT gateway for edge devices.
// See README.md; the command line lives in package cli.
package main

import (
	"os"

	"github.com/tandem-edge/tandem/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
