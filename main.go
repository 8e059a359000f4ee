// Command tandem is a durable, replicated MQTT gateway for edge devices.
// See README.md; the command line lives in package daemon.
package main

import (
	"os"

	"github.com/tandem-edge/tandem/daemon"
)

func main() {
	os.Exit(daemon.Main(os.Args[1:], os.Stdout, os.Stderr))
}
