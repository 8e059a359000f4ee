package main

import (
	"os/exec"
	"testing"
)

func TestDebVersion(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"v1.2.0", "1.2.0"},
		{"1.2.0", "1.2.0"},
		{"v1.2.0-rc.1", "1.2.0~rc.1"},
		{"v1.2.0-rc1", "1.2.0~rc1"},
		{"v1.2.0-5-gabc1234", "1.2.0+5.gabc1234"},
		{"v1.2.0-5-gabc1234-dirty", "1.2.0+5.gabc1234.dirty"},
		{"v1.2.0-dirty", "1.2.0+dirty"},
		{"v1.2.0-rc.1-3-gabc1234", "1.2.0~rc.1+3.gabc1234"},
		{"abc1234", "0.0.0+gitabc1234"},
		{"75f4373-dirty", "0.0.0+git75f4373.dirty"},
		{"dev", "0.0.0+gitdev"},
	} {
		got, err := debVersion(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("debVersion(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "v", "1.2.0_x", "1.2 .0"} {
		if got, err := debVersion(bad); err == nil {
			t.Errorf("debVersion(%q) = %q, want an error", bad, got)
		}
	}
}

// Debian's own comparison must order the versions as the commits are
// ordered: prerelease < release < commits after it < next release.
func TestDebVersionOrder(t *testing.T) {
	dpkg, err := exec.LookPath("dpkg")
	if err != nil {
		t.Skip("dpkg not found")
	}
	order := []string{"v1.2.0-rc.1", "v1.2.0", "v1.2.0-5-gabc1234", "v1.2.0-12-gdef5678", "v1.2.1-rc.1", "v1.2.1"}
	var debs []string
	for _, v := range order {
		d, err := debVersion(v)
		if err != nil {
			t.Fatal(err)
		}
		debs = append(debs, d)
	}
	for i := 1; i < len(debs); i++ {
		if err := exec.Command(dpkg, "--compare-versions", debs[i-1], "lt", debs[i]).Run(); err != nil {
			t.Errorf("dpkg: %s is not older than %s", debs[i-1], debs[i])
		}
	}
}
