package config

import (
	"fmt"
	"math/big"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// Duration is a time.Duration written in YAML as a Go duration string
// ("500ms", "5s", "10m"). A bare number other than 0 is refused rather than
// guessed: "5" could mean seconds, or nanoseconds as in time.Duration.
type Duration time.Duration

// Duration returns d as a time.Duration.
func (d Duration) Duration() time.Duration { return time.Duration(d) }

// String formats d as time.Duration does.
func (d Duration) String() string { return time.Duration(d).String() }

// MarshalYAML writes d in the form UnmarshalYAML reads.
func (d Duration) MarshalYAML() (any, error) { return d.String(), nil }

// UnmarshalYAML parses a non-negative Go duration. Its errors are
// *ConfigError with the node's line.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return &ConfigError{Line: n.Line, Msg: "expected a duration (e.g. 5s), got " + describeYAMLNode(n)}
	}
	v, err := parseConfigDuration(n.Value)
	if err != nil {
		return &ConfigError{Line: n.Line, Msg: err.Error()}
	}
	*d = Duration(v)
	return nil
}

func parseConfigDuration(s string) (time.Duration, error) {
	t := strings.TrimSpace(s)
	if t == "0" {
		return 0, nil
	}
	if isBareNumber(t) {
		return 0, fmt.Errorf("%s is not a duration (use a unit, e.g. %ss)", quoteConfigValue(s), t)
	}
	v, err := time.ParseDuration(t)
	if err != nil {
		return 0, fmt.Errorf("%s is not a duration (e.g. 500ms, 5s, 10m)", quoteConfigValue(s))
	}
	if v < 0 {
		return 0, fmt.Errorf("%s is negative", quoteConfigValue(s))
	}
	return v, nil
}

func isBareNumber(s string) bool {
	s = strings.TrimLeft(s, "+-")
	digits := false
	for _, r := range s {
		switch {
		case r >= '0' && r <= '9':
			digits = true
		case r != '.':
			return false
		}
	}
	return digits
}

// ByteSize is a size in bytes, written with a unit: "512MiB", "1GB",
// "10 MB", "1.5GiB", or a plain number of bytes ("1024"). KiB, MiB, GiB and
// TiB are powers of 1024, KB, MB, GB and TB powers of 1000 (units are not
// case-sensitive), so both habits mean what they say.
type ByteSize uint64

type byteUnit struct {
	name string
	mult uint64
}

// byteUnits runs from the largest unit down, the order String needs.
var byteUnits = []byteUnit{
	{"TiB", 1 << 40}, {"TB", 1e12}, {"GiB", 1 << 30}, {"GB", 1e9},
	{"MiB", 1 << 20}, {"MB", 1e6}, {"KiB", 1 << 10}, {"KB", 1e3}, {"B", 1},
}

// String formats b in the largest unit that divides it exactly, e.g.
// "512MiB", "1GB", "1536B", so that it parses back to the same value.
func (b ByteSize) String() string {
	for _, u := range byteUnits {
		if b != 0 && uint64(b)%u.mult == 0 {
			return strconv.FormatUint(uint64(b)/u.mult, 10) + u.name
		}
	}
	return strconv.FormatUint(uint64(b), 10) + "B"
}

// MarshalYAML writes b in the form UnmarshalYAML reads.
func (b ByteSize) MarshalYAML() (any, error) { return b.String(), nil }

// UnmarshalYAML parses a size. Its errors are *ConfigError with the node's
// line.
func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return &ConfigError{Line: n.Line, Msg: "expected a size (e.g. 512MiB), got " + describeYAMLNode(n)}
	}
	v, err := parseByteSize(n.Value)
	if err != nil {
		return &ConfigError{Line: n.Line, Msg: err.Error()}
	}
	*b = v
	return nil
}

var byteSizeRE = regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)$`)

func parseByteSize(s string) (ByteSize, error) {
	t := strings.TrimSpace(s)
	if strings.HasPrefix(t, "-") {
		return 0, fmt.Errorf("%s is negative", quoteConfigValue(s))
	}
	m := byteSizeRE.FindStringSubmatch(t)
	if m == nil {
		return 0, fmt.Errorf("%s is not a size (e.g. 512MiB, 1GB, 1024)", quoteConfigValue(s))
	}
	mult := uint64(1)
	if m[2] != "" {
		i := slices.IndexFunc(byteUnits, func(u byteUnit) bool { return strings.EqualFold(u.name, m[2]) })
		if i < 0 {
			return 0, fmt.Errorf("%s has an unknown unit %s (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)", quoteConfigValue(s), quoteConfigValue(m[2]))
		}
		mult = byteUnits[i].mult
	}
	// Exact arithmetic: "1.5GiB" is a whole number of bytes, and float64
	// would round large sizes.
	whole, frac, _ := strings.Cut(m[1], ".")
	num, _ := new(big.Int).SetString(whole+frac, 10)
	num.Mul(num, new(big.Int).SetUint64(mult))
	den := new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(len(frac))), nil)
	q, r := num.QuoRem(num, den, new(big.Int))
	if r.Sign() != 0 {
		return 0, fmt.Errorf("%s is not a whole number of bytes", quoteConfigValue(s))
	}
	if !q.IsUint64() {
		return 0, fmt.Errorf("%s is too large (at most 16 EiB)", quoteConfigValue(s))
	}
	return ByteSize(q.Uint64()), nil
}
