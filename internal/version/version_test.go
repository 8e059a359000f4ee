package version

import (
	"runtime/debug"
	"testing"
)

func stamp(mainVersion, rev, modified string) *debug.BuildInfo {
	return &debug.BuildInfo{Main: debug.Module{Path: "github.com/tandem-edge/tandem", Version: mainVersion},
		Settings: []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified}}}
}

// A plain go build must report what make build reports for the same tree:
// make build passes git describe and the short hash through -X.
func TestPlainBuildSaysWhatMakeBuildSays(t *testing.T) {
	const rev = "8d6c68612345678901234567890abcdef0123456"
	for _, tc := range []struct {
		name                  string
		bi                    *debug.BuildInfo
		describe, shortCommit string // what the Makefile would pass
		want                  string
	}{
		{"untagged", stamp("(devel)", rev, "false"), "8d6c686", "8d6c686", "0.0.0+git8d6c686"},
		{"untagged, edited", stamp("v0.0.0-20261201113641-8d6c68612345+dirty", rev, "true"), "8d6c686-dirty", "8d6c686", "0.0.0+git8d6c686.dirty"},
		{"at a tag", stamp("v1.2.0", rev, "false"), "v1.2.0", "8d6c686", "1.2.0"},
		{"at a prerelease tag", stamp("v1.3.0-rc.1", rev, "false"), "v1.3.0-rc.1", "8d6c686", "1.3.0~rc.1"},
	} {
		gv, gc := resolve(UnsetVersion, UnsetCommit, tc.bi, true)
		mv, mc := resolve(tc.describe, tc.shortCommit, tc.bi, true)
		if gv != tc.want || mv != tc.want || gc != "8d6c686" || mc != "8d6c686" {
			t.Errorf("%s: go build says %s (commit %s), make build %s (commit %s); want %s (commit 8d6c686)", tc.name, gv, gc, mv, mc, tc.want)
		}
	}
}

func TestNoStampSaysDev(t *testing.T) {
	// go run and go test binaries carry no VCS stamp.
	bi := &debug.BuildInfo{Main: debug.Module{Path: "github.com/tandem-edge/tandem", Version: "(devel)"}}
	if v, c := resolve(UnsetVersion, UnsetCommit, bi, true); v != "dev" || c != "unknown" {
		t.Errorf("no stamp: %s (commit %s), want dev (commit unknown)", v, c)
	}
	if v, c := resolve(UnsetVersion, UnsetCommit, nil, false); v != "dev" || c != "unknown" {
		t.Errorf("no build info: %s (commit %s)", v, c)
	}
}
