package daemon

import (
	"context"
	"errors"
	"time"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/cluster"
)

// clusterAPI is the control plane as the admin server's cluster endpoints
// see it (admin.Cluster).
type clusterAPI struct{ gw *cluster.Gateway }

func (c clusterAPI) Invite(ctx context.Context, ttl time.Duration) (string, time.Time, error) {
	token, err := c.gw.Invite(ctx, ttl)
	if err != nil {
		return "", time.Time{}, apiError(err)
	}
	tok, _, err := cluster.ParseToken(token, time.Now())
	if err != nil {
		return "", time.Time{}, err
	}
	return token, time.Unix(tok.Expires, 0), nil
}

func (c clusterAPI) Join(ctx context.Context, token, mode string) (admin.JoinResponse, error) {
	j, err := c.gw.Join(ctx, token, cluster.JoinMode(mode))
	return admin.JoinResponse(j), apiError(err)
}

func (c clusterAPI) Remove(ctx context.Context, node string, force bool) (string, error) {
	removed, err := c.gw.Remove(ctx, node, force)
	return removed, apiError(err)
}

func (c clusterAPI) Promote(ctx context.Context, force bool) (admin.PromoteResponse, error) {
	deposed, gen, err := c.gw.Promote(ctx, force)
	return admin.PromoteResponse{Deposed: deposed, Generation: gen}, apiError(err)
}

func (c clusterAPI) OpenPairing(ctx context.Context, ttl time.Duration) (string, time.Time, error) {
	code, expires, err := c.gw.OpenPairing(ctx, ttl)
	return code, expires, apiError(err)
}

func (c clusterAPI) PairJoin(ctx context.Context, code, mode string, within time.Duration, addr string) (admin.JoinResponse, error) {
	j, err := c.gw.PairJoin(ctx, code, cluster.JoinMode(mode), within, addr)
	return admin.JoinResponse(j), apiError(err)
}

// apiError marks the control plane's "no master now" for the API (503);
// the message stays the control plane's.
func apiError(err error) error {
	if err != nil && errors.Is(err, cluster.ErrNoMaster) {
		return noMaster{err}
	}
	return err
}

type noMaster struct{ error }

func (e noMaster) Unwrap() error      { return e.error }
func (noMaster) Is(target error) bool { return target == admin.ErrNoMaster }
