// Package packaging holds what an installed tandem is made of besides its
// binary: the systemd unit, the default configuration and the environment
// file. The .deb ships these files as they are; `tandem service install`
// embeds the same unit and default configuration through this package, so
// the two installs cannot drift apart. It is a leaf with no imports of ours.
package packaging

import _ "embed"

// Unit is tandem.service, the systemd unit. Its ExecStart runs
// /usr/bin/tandem with /etc/tandem/tandem.yaml.
//
//go:embed tandem.service
var Unit string

// Config is tandem.yaml, the commented configuration installed as
// /etc/tandem/tandem.yaml.
//
//go:embed tandem.yaml
var Config string

// UnitExecStart is the ExecStart line of Unit, exactly as written there:
// `tandem service install` replaces it to run the binary it was started
// from with the configuration it was given.
const UnitExecStart = "ExecStart=/usr/bin/tandem run --config /etc/tandem/tandem.yaml $TANDEM_OPTS"
