package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// Daemon is one running gateway: storage, replication, broker and the HTTP
// listener, started in that order and stopped in reverse.
type Daemon struct {
	cfg    *Config
	log    *slog.Logger
	id     *replication.Identity
	db     *storage.DB
	node   *replication.Node
	broker *mqtt.Broker
	apply  *applier

	httpSrv *http.Server
	httpLn  net.Listener

	reloadMu sync.Mutex // serialises Reload; guards live
	live     *Config    // the configuration in force: cfg, then each reload's

	stopOnce sync.Once
}

// New validates cfg; Start does the work.
func New(cfg *Config, log *slog.Logger) (*Daemon, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Daemon{cfg: cfg, log: log}, nil
}

// Start opens the data dir and starts serving. On error everything started
// so far is stopped again.
func (d *Daemon) Start(ctx context.Context) (err error) {
	defer func() {
		if err != nil {
			d.Stop()
		}
	}()
	c := d.cfg
	if err = notYet(c); err != nil {
		return err
	}
	// The users, ACL and TLS files are configuration too: a bad one exits
	// 2, before the data dir is touched.
	access, err := loadAccess(c.MQTT)
	if err != nil {
		return usageError{err}
	}
	tlsCfg, err := mqttTLS(c.MQTT.TLS)
	if err != nil {
		return usageError{err}
	}
	d.live = c
	if c.Discovery.MDNS {
		d.log.Warn("discovery.mdns is on, but mDNS is not implemented in this version: nothing is advertised")
	}
	if err = os.MkdirAll(c.Node.DataDir, 0o750); err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	if d.id, err = replication.LoadOrCreateIdentity(c.Node.DataDir); err != nil {
		return err
	}
	d.log = d.log.With("node", replication.ShortID(d.id.ID))
	if d.db, err = storage.Open(c.Node.DataDir, &storage.Options{Logger: d.log, SyncDelay: benchSyncDelay()}); err != nil {
		return err
	}
	topics, err := d.topicPolicies(c.Topics)
	if err != nil {
		return err
	}
	la := &logAdapter{}
	d.broker, err = mqtt.New(mqtt.Config{
		Listen:         c.MQTT.Listen,
		TLS:            tlsCfg,
		AllowAnonymous: access.AllowAnonymous,
		Users:          access.Users,
		ACL:            access.ACL,
		Limits:         mqttLimits(c.MQTT),
		MaxInflight:    c.MQTT.MaxInflight,
		MaxPacketSize:  uint32(c.MQTT.MaxPacketSize),
		Topics:         topics,
		SyncTimeout:    c.Cluster.SyncTimeout.Duration(),
		Sessions:       sessionStore{d.db},
		Logger:         d.log.With("component", "mqtt"),
	}, la)
	if err != nil {
		return err
	}
	d.apply = &applier{ready: make(chan struct{}), broker: d.broker}
	d.node, err = replication.NewNode(replication.Config{
		Identity:        d.id,
		Storage:         d.db,
		Applier:         d.apply,
		Logger:          d.log.With("component", "replication"),
		Heartbeat:       c.Cluster.Heartbeat.Duration(),
		ElectionTimeout: c.Cluster.ElectionTimeout.Duration(),
		SyncTimeout:     c.Cluster.SyncTimeout.Duration(),
		MinSyncReplicas: c.Cluster.MinSyncReplicas,
		AfterResolve:    d.broker.ReleaseAcks,
	})
	if err != nil {
		return err
	}
	la.node, la.db = d.node, d.db
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second+c.Cluster.ElectionTimeout.Duration())
	err = d.node.WaitLeader(wctx)
	cancel()
	if err != nil {
		return fmt.Errorf("waiting for a master: %w", err)
	}
	if err = d.broker.Start(); err != nil {
		return err
	}
	close(d.apply.ready)
	if err = d.startHTTP(); err != nil {
		return err
	}
	d.log.Info("gateway started", "id", replication.IDString(d.id.ID), "name", c.Node.Name, "mqtt", d.broker.Addr(), "http", d.HTTPAddr(), "data", c.Node.DataDir)
	return nil
}

// Failed is closed when the node stops on its own (storage failure,
// corruption found while applying).
func (d *Daemon) Failed() <-chan struct{} { return d.node.Failed() }

// Err returns why the node failed.
func (d *Daemon) Err() error { return d.node.Err() }

// MQTTAddr returns the MQTT listener's address.
func (d *Daemon) MQTTAddr() string { return d.broker.Addr() }

// MQTTTLSAddr returns the MQTT-over-TLS listener's address, or "".
func (d *Daemon) MQTTTLSAddr() string { return d.broker.TLSAddr() }

// HTTPAddr returns the HTTP listener's address.
func (d *Daemon) HTTPAddr() string {
	if d.httpLn == nil {
		return ""
	}
	return d.httpLn.Addr().String()
}

// Stop stops the gateway: HTTP, broker (its clients' wills are logged),
// replication, storage.
func (d *Daemon) Stop() error {
	var errs []error
	d.stopOnce.Do(func() {
		if d.httpSrv != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_ = d.httpSrv.Shutdown(ctx)
			cancel()
		}
		if d.broker != nil {
			if d.apply != nil {
				select {
				case <-d.apply.ready:
				default:
					close(d.apply.ready)
				}
			}
			if err := d.broker.Stop(); err != nil {
				errs = append(errs, err)
			}
		}
		if d.node != nil {
			d.node.Stop()
		}
		if d.db != nil {
			if err := d.db.Close(); err != nil {
				errs = append(errs, err)
			}
			d.log.Info("gateway stopped")
		}
	})
	return errors.Join(errs...)
}

func (d *Daemon) startHTTP() error {
	ln, err := net.Listen("tcp", d.cfg.HTTP.Listen)
	if err != nil {
		return fmt.Errorf("http: %w", err)
	}
	d.httpLn = ln
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		if d.node.Err() != nil {
			http.Error(w, d.node.Err().Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /v1/status", d.handleStatus)
	d.registerFieldView(mux)
	d.httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := d.httpSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			d.log.Error("http server stopped", "error", err)
		}
	}()
	return nil
}

// notYet refuses settings this version accepts in a config file but does
// not enforce yet: running without a cap, a user list or TLS the operator
// asked for would be worse than not starting.
func notYet(c *Config) error {
	var keys []string
	if c.Storage.Flush == "interval" {
		keys = append(keys, "storage.flush: interval")
	}
	if c.Storage.MaxBytes != 0 {
		keys = append(keys, "storage.max_bytes")
	}
	if c.Storage.MaxAge != 0 {
		keys = append(keys, "storage.max_age")
	}
	if len(keys) > 0 {
		return usageError{fmt.Errorf("not supported by this version yet: %s", strings.Join(keys, ", "))}
	}
	return nil
}

// benchSyncDelay reads TANDEM_BENCH_FSYNC_DELAY (a Go duration), which
// makes every fdatasync that long: what a gateway's SD card or eMMC would
// give, measured on a fast disk. For benchmarks only; never set it on a
// gateway, it only slows acks down.
func benchSyncDelay() time.Duration {
	d, _ := time.ParseDuration(os.Getenv("TANDEM_BENCH_FSYNC_DELAY"))
	return d
}
