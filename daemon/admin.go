package daemon

import (
	"context"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
)

// fieldView returns the daemon's field view, creating it on first use: the
// storage options, the broker config and the HTTP listener all need it
// during Start, which runs on one goroutine.
func (d *Daemon) fieldView() *admin.FieldView {
	if d.fv == nil {
		d.fv = admin.NewFieldView(adminGateway{d}, d.cfg, d.log)
	}
	return d.fv
}

// adminGateway is the daemon as admin.Gateway: what the admin server, the
// metrics and the status page read of it.
type adminGateway struct{ d *Daemon }

func (g adminGateway) Status(ctx context.Context) (*admin.Status, error) { return g.d.status(ctx) }
func (g adminGateway) Err() error                                        { return g.d.notServing() }
func (g adminGateway) Retained() int64                                   { return g.d.broker.Retained() }
func (g adminGateway) Promotions() uint64                                { return g.d.gw.Promotions() }
func (g adminGateway) Depositions() uint64                               { return g.d.gw.Depositions() }

func (g adminGateway) Live() *config.Config { return g.d.liveConfig() }

func (g adminGateway) LeaderChanges(ctx context.Context) (uint64, error) {
	rs, err := g.d.gw.Node().Status(ctx)
	return rs.LeaderChanges, err
}
