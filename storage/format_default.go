//go:build !tandem_format6

package storage

// newDirsSegmented says whether a new data dir is made in format 6, whose
// WAL segments are the log. Not yet in a release: the build tag
// tandem_format6 sets it, so that the gateway's own tests (power cuts,
// make bench) can run on format 6 before it is the default.
const newDirsSegmented = false
