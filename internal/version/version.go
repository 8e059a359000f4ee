// Package version is tandem's one version scheme: the Debian version of
// what `git describe --tags --always --dirty` says (v1.2.0 → 1.2.0, a bare
// commit abc1234 → 0.0.0+gitabc1234), used by both the .deb packages
// (packaging/mkdeb) and `tandem version`, so that the package and the
// binary in it name one version the same way. A binary built by `make
// build` has the describe string from the linker (-X); one built by a
// plain `go build` in a checkout gets it from the VCS stamp Go embeds
// (runtime/debug.ReadBuildInfo), so both say the same.
package version

import (
	"fmt"
	"regexp"
	"runtime/debug"
	"strings"
)

var (
	// describeRE splits `git describe --tags --dirty` output past a tag:
	// v1.2.0-5-gabc1234-dirty.
	describeRE = regexp.MustCompile(`^(.+?)-([0-9]+)-g([0-9a-f]+)(-dirty)?$`)
	debianRE   = regexp.MustCompile(`^[0-9][A-Za-z0-9.+~]*$`)
)

// Debian turns what `git describe --tags --always --dirty` prints into
// a Debian version that sorts the way the commits do: v1.2.0 → 1.2.0,
// v1.2.0-rc.1 → 1.2.0~rc.1 (before 1.2.0), v1.2.0-5-gabc1234 →
// 1.2.0+5.gabc1234 (after it), a bare hash abc1234 → 0.0.0+gitabc1234,
// and -dirty becomes +dirty / .dirty.
func Debian(describe string) (string, error) {
	s := strings.TrimPrefix(strings.TrimSpace(describe), "v")
	if s == "" {
		return "", fmt.Errorf("empty version")
	}
	dirty := strings.HasSuffix(s, "-dirty")
	var v string
	switch m := describeRE.FindStringSubmatch(s); {
	case m != nil:
		v = tagVersion(m[1]) + "+" + m[2] + ".g" + m[3]
		dirty = m[4] != ""
	case !strings.Contains(s, "."):
		// No tag: a bare commit hash, or "dev".
		v = "0.0.0+git" + strings.TrimSuffix(s, "-dirty")
	default:
		v = tagVersion(strings.TrimSuffix(s, "-dirty"))
	}
	if dirty {
		if strings.Contains(v, "+") {
			v += ".dirty"
		} else {
			v += "+dirty"
		}
	}
	if !debianRE.MatchString(v) {
		return "", fmt.Errorf("version %q gives %q, which is not a Debian version", describe, v)
	}
	return v, nil
}

// tagVersion maps a tag's semver prerelease to Debian's "~", which sorts
// before the release as a prerelease should.
func tagVersion(tag string) string {
	if i := strings.IndexByte(tag, '-'); i >= 0 {
		return tag[:i] + "~" + strings.ReplaceAll(tag[i+1:], "-", ".")
	}
	return tag
}

// Unset are the values of the linker-set variables when the build did not
// set them (a plain go build): Version and Commit.
const (
	UnsetVersion = "dev"
	UnsetCommit  = "unknown"
)

// Resolve returns the version and short commit a binary reports. ldVersion
// and ldCommit are what the linker set (make build: git describe and git
// rev-parse --short); when it set nothing they come from the VCS stamp of
// the build. The version is given in the package scheme (Debian); a
// string that does not convert is kept as it is.
func Resolve(ldVersion, ldCommit string) (version, commit string) {
	bi, ok := debug.ReadBuildInfo()
	return resolve(ldVersion, ldCommit, bi, ok)
}

func resolve(ldVersion, ldCommit string, bi *debug.BuildInfo, ok bool) (version, commit string) {
	version, commit = ldVersion, ldCommit
	if ok && (version == UnsetVersion || commit == UnsetCommit) {
		if describe, c, found := fromBuildInfo(bi); found {
			if version == UnsetVersion {
				version = describe
			}
			if commit == UnsetCommit {
				commit = c
			}
		}
	}
	if version == UnsetVersion {
		return version, commit // no stamp at all (go run, go test): say so plainly
	}
	if v, err := Debian(version); err == nil {
		version = v
	}
	return version, commit
}

// pseudoRE matches a Go pseudo-version (v0.0.0-20261201113641-abcdef123456),
// which Go gives a build that is not at a tag.
var pseudoRE = regexp.MustCompile(`[0-9]{14}-[0-9a-f]{12}$`)

// shortHash is how many hex digits of the revision git describe and git
// rev-parse --short print in a repository of tandem's size.
const shortHash = 7

// fromBuildInfo rebuilds from Go's VCS stamp what git describe would have
// printed: the tag when the build is at one (Go sets the main module's
// version to it), else the short commit, with -dirty for uncommitted
// changes. Past a tag Go knows no commit count, so that case gives the bare
// commit where git describe gives v1.2.0-5-gabc1234; make build, which
// packages use, has the count. found is false without a VCS stamp (a build
// outside a checkout, or with -buildvcs=false).
func fromBuildInfo(bi *debug.BuildInfo) (describe, commit string, found bool) {
	var rev string
	var dirty bool
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev == "" {
		return "", "", false
	}
	commit = rev[:min(len(rev), shortHash)]
	describe = commit
	if v := strings.TrimSuffix(bi.Main.Version, "+dirty"); strings.HasPrefix(v, "v") && !pseudoRE.MatchString(v) {
		describe = v
	}
	if dirty {
		describe += "-dirty"
	}
	return describe, commit, true
}
