package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/cluster"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// Daemon is one running gateway: storage, replication, broker and the HTTP
// listener, started in that order and stopped in reverse.
type Daemon struct {
	cfg    *config.Config
	log    *slog.Logger
	id     *replication.Identity
	db     *storage.DB
	broker *mqtt.Server
	apply  *applier
	gw     *cluster.Gateway // the control plane: the node in force and the cluster
	// redeliver keeps a deposed master's subscribers from getting its
	// tail twice; it sits in front of apply (redeliver.go).
	redeliver *redeliverer

	// failc is closed when the gateway can no longer serve: the node
	// in force failed (storage, corruption) or could not be replaced.
	failc    chan struct{}
	failErr  atomic.Pointer[error]
	failOnce sync.Once

	http *admin.Server // the admin API, metrics and page, made by startHTTP

	reloadMu sync.Mutex     // serialises Reload; guards live
	live     *config.Config // the configuration in force: cfg, then each reload's

	stopOnce sync.Once

	fv *admin.FieldView // metrics and the page's history, made by fieldView()

	serving servingWatch // whether publishes are taken; devices sent away (serving.go)
	acks    *ackQueue    // proposal outcomes, from replication's goroutine to the broker (acks.go)
	ups     *uplinks     // the cloud uplinks; nil without any (uplinks.go)
	skips   *skips       // the records the applier skipped (records.go)

	// resync is set while this gateway, whose data file was damaged,
	// rejoins its cluster (resync.go); lost once it did, or from an
	// earlier run.
	resync *resyncState
	lost   atomic.Pointer[resyncState]
}

// New validates cfg; Start does the work.
func New(cfg *config.Config, log *slog.Logger) (*Daemon, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Daemon{cfg: cfg, log: log, failc: make(chan struct{})}, nil
}

// Start opens the data dir and starts serving. On error everything started
// so far is stopped again.
func (d *Daemon) Start(ctx context.Context) (err error) {
	lg := d.log
	clock.Default.OnJump(func(jump, offset time.Duration) {
		lg.Warn("the wall clock jumped: absorbed; record times, max_age and message expiry run on without the jump",
			"jump", jump.Round(time.Millisecond), "offset", offset.Round(time.Millisecond))
	})
	defer func() {
		if err != nil {
			d.Stop()
		}
	}()
	c := d.cfg
	// The users, ACL and TLS files are configuration too: a bad one exits
	// 2, before the data dir is touched.
	in, err := loadInputs(c)
	if err != nil {
		return config.UsageError{Err: err}
	}
	access, tlsCfg := in.access, in.tls
	admin.WarnLooseMode(d.log, "mqtt.users_file", c.MQTT.UsersFile)
	admin.WarnLooseMode(d.log, "mqtt.tls.key_file", c.MQTT.TLS.KeyFile)
	d.live = c
	if err = os.MkdirAll(c.Node.DataDir, 0o750); err != nil {
		return mkdirError(c.Node.DataDir, err)
	}
	if err = checkDataDir(c.Node.DataDir); err != nil {
		return err
	}
	if d.id, err = replication.LoadOrCreateIdentity(c.Node.DataDir); err != nil {
		return err
	}
	plain := d.log
	d.log = plain.With("node", replication.ShortID(d.id.ID))
	if err = d.openData(plain); err != nil {
		return err
	}
	snapshotBuckets(d.db)
	topics, err := d.topicPolicies(c.Topics)
	if err != nil {
		return err
	}
	if d.gw, err = cluster.NewGateway(c, d.log, d.id, d.db, clusterHost{d}); err != nil {
		return err
	}
	if err = d.gw.StartTransport(); err != nil {
		return fmt.Errorf("peer port: %w", inUse(err, "peer address", c.Peer.Listen, "--peer", "peer.listen"))
	}
	d.fieldView().RegisterPeerPort(d.gw)
	d.acks = newAckQueue()
	d.skips = newSkips(d.log, d.fieldView().RecordSkipped)
	la := &logAdapter{d: d}
	d.broker, err = mqtt.NewServer(mqtt.Config{
		Now:            clock.Now, // record times and message expiry: wall-clock jumps absorbed
		Listen:         c.MQTT.Listen,
		TLS:            tlsCfg,
		AllowAnonymous: access.AllowAnonymous,
		Users:          access.Users,
		ACL:            access.ACL,
		Limits:         mqttLimits(c),
		MaxInflight:    c.MQTT.MaxInflight,
		MaxPacketSize:  uint32(c.MQTT.MaxPacketSize),
		WebSocket:      mqttWebSocket(c.MQTT.WebSocket),

		NodeID:                  d.id.ID,
		MaxQueued:               c.MQTT.MaxQueued,
		MaxQueuedBytes:          int64(c.MQTT.MaxQueuedBytes),
		MaxInflightOut:          c.MQTT.MaxInflightOut,
		MaxInflightOutBytes:     int64(c.MQTT.MaxInflightOutBytes),
		DisconnectWhenQueueFull: c.MQTT.QueueFull == "disconnect",
		TopicAliasMaximum:       uint16(c.MQTT.TopicAliasMaximum),
		AckReasonStrings:        c.MQTT.ReasonStrings == "all",
		Topics:                  topics,
		TakeoverWait:            c.Cluster.SyncTimeout.Duration(),
		Sessions:                sessionStore{d.db},
		Logger:                  d.log.With("component", "mqtt"),
		Observer:                d.fieldView(),
		Unreadable:              d.skips.note,
	}, la)
	if err != nil {
		return inUse(err, "MQTT address", c.MQTT.Listen, "--mqtt", "mqtt.listen")
	}
	if d.ups, err = newUplinks(d); err != nil {
		return err
	}
	if d.ups != nil {
		d.fieldView().RegisterUplinks(d.ups)
	}
	d.fieldView().RegisterMemory(d.broker.MemoryUsed, d.broker.HeldForMemory, int64(c.Limits.Memory))
	d.fieldView().RegisterBrokerState(d.broker.Retained, d.broker.RetainedBytes, d.broker.PersistentSessions)
	d.fieldView().RegisterQoS0Dropped(d.broker.QoS0Dropped)
	d.fieldView().RegisterClock(clock.Default)
	d.fieldView().RegisterSessionBytes(d.broker.SessionBytes)
	d.apply = &applier{ready: make(chan struct{}), broker: d.broker, ups: d.ups, skips: d.skips}
	d.redeliver = &redeliverer{d: d}
	if d.resync != nil {
		err = d.gw.StartNodeResyncing()
	} else {
		err = d.gw.StartNode()
	}
	if err != nil {
		return err
	}
	n := d.gw.Node()
	// A member-to-be (rejoining after damage, d.resync, or restarted in a
	// join before the master's first entry) has no membership and no
	// master until the cluster's takes it in; its devices get the
	// sync_timeout outcome meanwhile.
	toBe := d.resync != nil || len(n.Members()) == 0
	if len(n.Members()) <= 1 && !toBe {
		// A lone gateway leads at once; wait for it so the first
		// publishes do not meet a node still campaigning. A member of a
		// cluster serves whether or not a master is in sight: its
		// devices get the sync_timeout outcome until one is.
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second+c.Cluster.ElectionTimeout.Duration())
		err = n.WaitLeader(wctx)
		cancel()
		if err != nil {
			return fmt.Errorf("waiting for a master: %w", err)
		}
	} else if c.Cluster.MinSyncReplicas > len(n.Members())-1 && d.gw.HasSyncTopics() && !toBe {
		d.log.Warn("min_sync_replicas is larger than the number of other members: sync topics cannot be acked", "min_sync_replicas", c.Cluster.MinSyncReplicas, "members", len(n.Members()))
	}
	if len(n.Members()) <= 1 && d.gw.HasSyncTopics() && !toBe {
		d.log.Warn("this gateway has no slave: publishes on sync topics will get the sync_timeout outcome until one joins")
	}
	d.gw.StartKeeper()
	if d.resync != nil {
		d.startResync()
	}
	d.broker.Applied(d.db.Applied())
	if n.StateIncomplete() {
		// Not even for the moment before the serving watch's first look.
		why, ref := d.incompleteServing(n, n.Members())
		d.sendDevices(why, ref, true)
	}
	if err = d.broker.Start(); err != nil {
		return inUse(err, "MQTT address", c.MQTT.Listen, "--mqtt", "mqtt.listen")
	}
	close(d.apply.ready)
	d.startServingWatch()
	d.ups.start()
	if err = d.startHTTP(); err != nil {
		return err
	}
	d.log.Info("gateway started", "id", replication.IDString(d.id.ID), "name", c.Node.Name, "mqtt", d.broker.Addr(), "http", d.HTTPAddr(), "peer", d.gw.PeerAddr(), "cluster", d.gw.ClusterID(), "members", len(n.Members()), "data", c.Node.DataDir)
	return nil
}

// Failed is closed when the node stops on its own (storage failure,
// corruption found while applying).
func (d *Daemon) Failed() <-chan struct{} { return d.failc }

// Err returns why the node failed.
func (d *Daemon) Err() error {
	if e := d.failErr.Load(); e != nil {
		return *e
	}
	return nil
}

// fail stops the gateway from serving: Failed is closed.
func (d *Daemon) fail(err error) {
	d.failOnce.Do(func() {
		d.failErr.Store(&err)
		close(d.failc)
	})
}

// PeerAddr returns the peer listener's address.
func (d *Daemon) PeerAddr() string { return d.gw.PeerAddr() }

// MQTTAddr returns the MQTT listener's address.
func (d *Daemon) MQTTAddr() string { return d.broker.Addr() }

// MQTTWSAddr returns the MQTT-over-WebSocket listener's address, or "".
func (d *Daemon) MQTTWSAddr() string { return d.broker.WSAddr() }

// MQTTTLSAddr returns the MQTT-over-TLS listener's address, or "".
func (d *Daemon) MQTTTLSAddr() string { return d.broker.TLSAddr() }

// HTTPAddr returns the HTTP listener's address.
func (d *Daemon) HTTPAddr() string {
	if d.http == nil {
		return ""
	}
	return d.http.Addr()
}

// Stop stops the gateway: HTTP, uplinks, broker (its clients' wills are
// logged), replication, storage.
func (d *Daemon) Stop() error {
	var errs []error
	d.stopOnce.Do(func() {
		d.markStopping()
		if d.fv != nil {
			d.fv.Stop()
		}
		if d.http != nil {
			d.http.Stop()
		}
		d.stopServingWatch()
		// Before the broker and replication: each uplink proposes its
		// position a last time.
		d.ups.stop()
		if d.broker != nil {
			if d.apply != nil {
				select {
				case <-d.apply.ready:
				default:
					close(d.apply.ready)
				}
			}
			switch err := d.broker.Stop(); {
			case noSpace(err):
				d.log.Warn("stopped without writing the sessions' last state (cursors, packet ids): the disk is full; the next start goes on from the state written before, so a session may get some messages again", "error", err)
			case err != nil:
				errs = append(errs, err)
			}
		}
		if d.gw != nil {
			d.gw.Stop()
		}
		if d.acks != nil {
			d.acks.stop() // after replication: its last outcomes (stopped) reach the broker
		}
		if d.db != nil {
			err := d.db.Close()
			switch {
			case errors.Is(err, storage.ErrNotCheckpointed):
				// A full disk: the data file could not take the WAL's
				// last entries, but the WAL holds them, fsynced; the
				// next start replays them. A clean stop all the same.
				d.log.Warn("stopped without checkpointing the WAL into the data file: nothing is lost, the next start replays it from the WAL; free space on the data dir's filesystem before then", "error", err, "data", d.cfg.Node.DataDir)
			case err != nil:
				errs = append(errs, err)
			}
			d.log.Info("gateway stopped")
		}
	})
	return errors.Join(errs...)
}

// noSpace reports whether err is the filesystem's lack of room (a full
// disk, a quota, a file size limit): what a stop may meet and survive.
func noSpace(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) || errors.Is(err, syscall.EFBIG)
}

// startHTTP serves the admin API, the metrics and the status page (admin/),
// with the cluster's endpoints added.
func (d *Daemon) startHTTP() error {
	srv, err := admin.NewServer(d.cfg, d.log, adminGateway{d}, d.fieldView())
	if err != nil {
		return err
	}
	srv.HandleCluster(clusterAPI{d.gw})
	srv.HandleMutating("/v1/log", d.handleLog)
	srv.HandleUplinks(uplinkAPI{d})
	if err := srv.Start(d.cfg.HTTP.Listen); err != nil {
		return fmt.Errorf("http: %w", inUse(err, "HTTP address", d.cfg.HTTP.Listen, "--http", "http.listen"))
	}
	d.http = srv
	return nil
}

// flushInterval is storage.Options.FlushInterval for the config: zero
// (fsync before every ack) unless flush is interval.
func flushInterval(c config.StorageConfig) time.Duration {
	if c.Flush != "interval" {
		return 0
	}
	return time.Duration(c.FlushInterval)
}

// benchSyncDelay reads TANDEM_BENCH_FSYNC_DELAY (a Go duration), which
// makes every fdatasync that long: what a gateway's SD card or eMMC would
// give, measured on a fast disk. For benchmarks only; never set it on a
// gateway, it only slows acks down.
func benchSyncDelay() time.Duration {
	d, _ := time.ParseDuration(os.Getenv("TANDEM_BENCH_FSYNC_DELAY"))
	return d
}
