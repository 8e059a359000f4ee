package daemon

import (
	"context"
	"errors"
	"time"

	"github.com/tandem-edge/tandem/replication"
)

// onPair answers a pairing knock on the peer port.
func (c *cluster) onPair(ctx context.Context, r replication.Remote, payload []byte) ([]byte, error) {
	return nil, errors.New("pairing is not open on this gateway")
}

// pairState says whether pairing is open, and until when.
func (c *cluster) pairState() (open bool, expires time.Time) { return false, time.Time{} }
