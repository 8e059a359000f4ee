package version

// The binary's build information, set with -ldflags -X by the Makefile
// (git describe and the short commit). init turns them into the package
// version scheme and, for a plain go build that set neither, takes them from
// the VCS stamp Go embeds, so that every build of one tree reports one
// version. They live here, below every package that reports them (the CLI,
// the status JSON, the metrics, mDNS), so that none of those has to import
// another for it.
var (
	Version = UnsetVersion
	Commit  = UnsetCommit
)

func init() { Version, Commit = Resolve(Version, Commit) }
