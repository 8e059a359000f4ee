//go:build tandem_format6

package storage

// newDirsSegmented: a test build (go build -tags tandem_format6; never
// shipped) makes new data dirs in format 6. Data dirs that exist keep
// their format.
const newDirsSegmented = true
