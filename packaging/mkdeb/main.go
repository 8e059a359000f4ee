// Command mkdeb builds tandem's .deb packages with nfpm (as a library, so
// the version nfpm runs at is the one go.mod pins) from packaging/nfpm.yaml,
// one per architecture, from binaries built by `make cross`:
//
//	SOURCE_DATE_EPOCH=1700000000 go run ./packaging/mkdeb -version v1.2.0 \
//	    -commit abc1234 -bin bin -out dist amd64 arm64 arm
//
// Architectures are Go's: arm means GOARM=7, Debian's armhf. Every
// timestamp in a package is SOURCE_DATE_EPOCH, so the same inputs give the
// same bytes. `make package` is the usual way in.
package main

import (
	"bytes"
	"compress/gzip"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/goreleaser/nfpm/v2"
	"github.com/goreleaser/nfpm/v2/deb"

	"github.com/tandem-edge/tandem/internal/version"
)

func main() {
	var o options
	flag.StringVar(&o.config, "config", "packaging/nfpm.yaml", "nfpm configuration")
	flag.StringVar(&o.version, "version", "", "version as `git describe` prints it (converted to a Debian version)")
	flag.StringVar(&o.commit, "commit", "unknown", "commit the binaries were built from (for the changelog)")
	flag.StringVar(&o.binDir, "bin", "bin", "directory holding tandem-linux-<goarch>")
	flag.StringVar(&o.outDir, "out", "dist", "directory the packages are written to")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: mkdeb [flags] GOARCH... (amd64, arm64, arm)")
		flag.PrintDefaults()
	}
	flag.Parse()
	o.arches = flag.Args()
	epoch := os.Getenv("SOURCE_DATE_EPOCH")
	if epoch == "" {
		fail(fmt.Errorf("SOURCE_DATE_EPOCH is not set (make package sets it to the commit time) and packages must be reproducible"))
	}
	sec, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil {
		fail(fmt.Errorf("SOURCE_DATE_EPOCH=%q: %w", epoch, err))
	}
	o.mtime = time.Unix(sec, 0).UTC()
	paths, err := build(o)
	if err != nil {
		fail(err)
	}
	for _, p := range paths {
		fmt.Println(p)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "mkdeb:", err)
	os.Exit(1)
}

// options are mkdeb's inputs.
type options struct {
	config, version, commit, binDir, outDir string
	arches                                  []string
	mtime                                   time.Time
}

// debArch maps a Go architecture of `make cross` to nfpm's name for it.
var debArch = map[string]string{
	"amd64": "amd64",
	"arm64": "arm64",
	"arm":   "arm7", // nfpm: armhf
}

// build writes one package per architecture and returns their paths.
func build(o options) ([]string, error) {
	if len(o.arches) == 0 {
		return nil, fmt.Errorf("no architecture given (amd64, arm64, arm)")
	}
	version, err := debVersion(o.version)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(o.outDir, 0o755); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "mkdeb-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	var paths []string
	for _, goarch := range o.arches {
		p, err := buildOne(o, goarch, version, tmp)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", goarch, err)
		}
		paths = append(paths, p)
	}
	return paths, nil
}

// buildOne writes the package for one architecture; tmp takes the files
// mkdeb generates (changelog, compressed man page).
func buildOne(o options, goarch, version, tmp string) (string, error) {
	arch, ok := debArch[goarch]
	if !ok {
		return "", fmt.Errorf("unknown architecture (amd64, arm64, arm)")
	}
	bin, err := filepath.Abs(filepath.Join(o.binDir, "tandem-linux-"+goarch))
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("binary missing (make cross builds it): %w", err)
	}
	vars := map[string]string{"TANDEM_VERSION": version, "TANDEM_ARCH": arch, "TANDEM_BINARY": bin}
	cfg, err := nfpm.ParseFileWithEnvMapping(o.config, func(k string) string { return vars[k] })
	if err != nil {
		return "", fmt.Errorf("%s: %w", o.config, err)
	}
	info, err := cfg.Get("deb")
	if err != nil {
		return "", err
	}
	info = nfpm.WithDefaults(info)
	// Relative sources are relative to the configuration, so mkdeb works
	// from any directory.
	dir := filepath.Dir(o.config)
	rel := func(p string) string {
		if p == "" || filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	for _, c := range info.Contents {
		c.Source = rel(c.Source)
		if strings.HasSuffix(c.Destination, ".gz") && !strings.HasSuffix(c.Source, ".gz") {
			if c.Source, err = gzipFile(c.Source, tmp); err != nil {
				return "", err
			}
		}
	}
	s := &info.Scripts
	s.PreInstall, s.PostInstall, s.PreRemove, s.PostRemove = rel(s.PreInstall), rel(s.PostInstall), rel(s.PreRemove), rel(s.PostRemove)
	full := info.Version
	if info.Release != "" {
		full += "-" + info.Release
	}
	info.Changelog = filepath.Join(tmp, "changelog.yml")
	if err := os.WriteFile(info.Changelog, changelogYAML(full, o.commit, o.mtime), 0o644); err != nil {
		return "", err
	}
	info.MTime = o.mtime
	if err := nfpm.Validate(info); err != nil {
		return "", err
	}
	target := filepath.Join(o.outDir, deb.Default.ConventionalFileName(info))
	f, err := os.Create(target)
	if err != nil {
		return "", err
	}
	info.Target = target
	if err := deb.Default.Package(info, f); err != nil {
		f.Close()
		os.Remove(target)
		return "", err
	}
	return target, f.Close()
}

// gzipFile compresses src into dir as gzip -n does: no name and no time
// in the header, so the bytes depend on the content alone.
func gzipFile(src, dir string) (string, error) {
	data, err := os.ReadFile(src)
	if err != nil {
		return "", err
	}
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		return "", err
	}
	if _, err := zw.Write(data); err != nil {
		return "", err
	}
	if err := zw.Close(); err != nil {
		return "", err
	}
	dst := filepath.Join(dir, filepath.Base(src)+".gz")
	return dst, os.WriteFile(dst, buf.Bytes(), 0o644)
}

// changelogYAML is the one-entry changelog (nfpm's chglog format) that
// becomes /usr/share/doc/tandem/changelog.Debian.gz.
func changelogYAML(version, commit string, date time.Time) []byte {
	return fmt.Appendf(nil, `- semver: %q
  date: %s
  packager: tandem maintainers <maintainers@tandem-edge.invalid>
  deb:
    urgency: medium
    distributions: [stable]
  changes:
    - note: "tandem %s, built from commit %s."
`, version, date.Format(time.RFC3339), version, commit)
}

// debVersion is the package version of a `git describe` string: the one
// scheme tandem version prints too (internal/version).
func debVersion(describe string) (string, error) { return version.Debian(describe) }
