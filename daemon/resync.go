package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/cluster"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// A cluster member whose data file fails its checks at start heals from
// its peers (storage.on_damage: resync; cluster/resync.go has the
// protocol): the damaged files and the old identity move to a directory
// of their own under damaged/ in the data dir, never deleted; the member
// starts on a fresh data file under a fresh identity, rejoins its cluster
// proven by the old one, and replays the master's log. What it held alone
// and cannot give back is reported by index range, loudly.

// resyncFile, in the data dir, marks a re-sync under way: a restart goes on
// with it rather than start as a new lone gateway.
const resyncFile = "resync.json"

// damagedDirName is the data dir's subdirectory the damaged files go to.
const damagedDirName = "damaged"

// metaLost, in the new data file, keeps what a re-sync could not recover,
// for status and metrics across restarts.
const metaLost = "storage.lost"

// resyncState is resyncFile's content, and what metaLost keeps once the
// re-sync is done.
type resyncState struct {
	Dir    string                `json:"damaged_dir"` // where the damaged files went
	At     time.Time             `json:"at"`
	Error  string                `json:"error"` // why the data file was refused
	Known  cluster.KnownCluster  `json:"known"` // the cluster to rejoin
	Survey storage.Survey        `json:"survey"`
	Lost   []storage.IndexRange  `json:"lost,omitempty"` // set once done
	Done   bool                  `json:"done,omitempty"`
	old    *replication.Identity // the identity of the damaged member
}

// storageOptions is the storage config of the gateway.
func (d *Daemon) storageOptions() *storage.Options {
	c := d.cfg
	return &storage.Options{Logger: d.log, SyncDelay: benchSyncDelay(), OnCommit: d.fieldView().OnCommit,
		MaxBytes: int64(c.Storage.MaxBytes), MaxAge: time.Duration(c.Storage.MaxAge), MinFree: int64(c.Storage.MinFree),
		FlushInterval: flushInterval(c.Storage), Clock: clock.Default}
}

// openData opens the data file. A damaged one of a cluster member is moved
// aside with its identity, and a fresh data file and identity take their
// place (on_damage: resync); a re-sync found under way goes on.
// plain is the logger without this node's id, which a fresh identity
// changes.
func (d *Daemon) openData(plain *slog.Logger) error {
	dir := d.cfg.Node.DataDir
	st, err := loadResync(dir)
	if err != nil {
		return err
	}
	if st != nil && d.id.ID == st.old.ID {
		// loadResync finished moving the old identity aside: make the
		// fresh one.
		if d.id, err = replication.LoadOrCreateIdentity(dir); err != nil {
			return err
		}
		d.log = plain.With("node", replication.ShortID(d.id.ID))
	}
	if st == nil {
		db, err := storage.Open(dir, d.storageOptions())
		if err == nil {
			d.db = db
			return d.loadLost()
		}
		if st, err = d.quarantine(err); err != nil {
			return err
		}
		d.log = plain.With("node", replication.ShortID(d.id.ID))
	}
	d.resync = st
	if d.db, err = storage.Open(dir, d.storageOptions()); err != nil {
		return err
	}
	return nil
}

// loadResync reads resyncFile in dir, nil when there is none, with the
// old identity it names.
func loadResync(dir string) (*resyncState, error) {
	b, err := os.ReadFile(filepath.Join(dir, resyncFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	var st resyncState
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("%s: %v (remove it to start this gateway as a new one)", filepath.Join(dir, resyncFile), err)
	}
	if _, err := os.Stat(filepath.Join(st.Dir, replication.KeyFile)); errors.Is(err, os.ErrNotExist) {
		// A crash came before the old key was moved: the key in the data
		// dir is still the old one (the new one is made after), and so is
		// whatever else is left there.
		if err := moveAside(dir, st.Dir); err != nil {
			return nil, err
		}
	}
	for _, f := range []string{replication.KeyFile, replication.CertFile} {
		if _, err := os.Stat(filepath.Join(st.Dir, f)); err != nil {
			return nil, fmt.Errorf("re-sync under way (%s), but the damaged member's identity is gone: %w", filepath.Join(dir, resyncFile), err)
		}
	}
	if st.old, err = replication.LoadOrCreateIdentity(st.Dir); err != nil {
		return nil, err
	}
	return &st, nil
}

// quarantine handles a data file that failed to open with openErr: unless
// it is damage (ErrCorrupt) in a member of a cluster with on_damage resync,
// it returns openErr unchanged. Otherwise it moves the damaged files and the
// identity aside, makes a fresh identity, and records the re-sync.
func (d *Daemon) quarantine(openErr error) (*resyncState, error) {
	dir := d.cfg.Node.DataDir
	if !errors.Is(openErr, storage.ErrCorrupt) || d.cfg.Storage.OnDamage != "resync" {
		return nil, openErr
	}
	known, err := cluster.ReadMembersFile(dir)
	if err != nil || known.Self != replication.IDString(d.id.ID) || len(known.Others()) == 0 {
		// A lone gateway (or one whose cluster is not known outside the
		// damaged file): nobody to heal from.
		d.log.Info("the data file is damaged and this gateway is not known to be a member of a cluster: nothing to re-sync from (tandem repair copies what is intact)", "error", openErr)
		return nil, openErr
	}
	survey := storage.SurveyDamaged(dir)
	dest := filepath.Join(dir, damagedDirName, time.Now().UTC().Format("20060102T150405.000Z"))
	old := d.id
	st := &resyncState{Dir: dest, At: time.Now().UTC(), Error: openErr.Error(), Known: known, Survey: survey, old: old}
	b, _ := json.MarshalIndent(st, "", "  ")
	// The record first: a crash part way through the moves goes on with
	// them at the next start (loadResync).
	if err := replication.WriteFileAtomic(filepath.Join(dir, resyncFile), b, 0o640); err != nil {
		return nil, fmt.Errorf("recording the re-sync: %w (%v)", err, openErr)
	}
	if err := moveAside(dir, dest); err != nil {
		return nil, fmt.Errorf("%w (%v)", err, openErr)
	}
	if d.id, err = replication.LoadOrCreateIdentity(dir); err != nil {
		return nil, err
	}
	d.log.Error("the data file failed its checks: moved aside (kept, never deleted); re-syncing the whole log from the cluster under a fresh member id",
		"error", openErr, "damaged_dir", dest, "unreadable", rangesText(survey.Unreadable, survey), "readable", rangesText(survey.Readable, survey),
		"old_id", replication.IDString(old.ID), "new_id", replication.IDString(d.id.ID), "cluster", known.Cluster)
	return st, nil
}

// moveAside moves the data files and the identity from dir to dest, the
// key last: until it is gone, the data dir is still the damaged member's.
func moveAside(dir, dest string) error {
	if err := os.MkdirAll(dest, 0o750); err != nil {
		return fmt.Errorf("moving the damaged data file aside: %w", err)
	}
	store, err := storage.Files(dir)
	if err != nil {
		return fmt.Errorf("moving the damaged data file aside: %w", err)
	}
	for _, n := range append(store, cluster.MembersFile, replication.CertFile, replication.KeyFile) {
		if err := os.Rename(filepath.Join(dir, n), filepath.Join(dest, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("moving the damaged %s aside: %w", n, err)
		}
	}
	syncDirs(dest, dir, filepath.Dir(dest))
	return nil
}

// rangesText words index ranges for the log.
func rangesText(rs []storage.IndexRange, s storage.Survey) string {
	if !s.Opened {
		return "unknown: the file could not be read (" + s.Why + ")"
	}
	if len(rs) == 0 {
		return "none"
	}
	const most = 20 // a line a person reads; status has them all
	parts := make([]string, 0, min(len(rs), most+1))
	for i, r := range rs {
		if i == most {
			parts = append(parts, fmt.Sprintf("and %d more ranges", len(rs)-most))
			break
		}
		parts = append(parts, r.String())
	}
	return strings.Join(parts, ",")
}

// startResync has the gateway rejoin its cluster (StartNodeResyncing
// started its node).
func (d *Daemon) startResync() {
	st := d.resync
	d.gw.Resync(st.old, st.Known, func(r cluster.Resynced) { d.resynced(r) })
}

// resynced runs once the master has admitted this gateway under its fresh
// id: what it held alone past the master's log is reported lost, the
// re-sync record goes.
func (d *Daemon) resynced(r cluster.Resynced) {
	cp := *d.resync // status reads d.resync meanwhile
	st := &cp
	from := r.MasterLast
	if r.Fork > 0 {
		from = r.Fork // a master promoted over: past the fork, the log was its own
	}
	st.Lost = lostPast(st.Survey, from)
	st.Done = true
	requeued := 0
	if st.Survey.Opened && st.Survey.Last > from {
		// Records past the master's log that still read are re-published
		// there, as a deposed master's tail is.
		var err error
		if requeued, err = d.db.RequeueSalvaged(st.Dir, from); err != nil {
			d.log.Error("re-publishing the readable records past the master's log failed: they are only in the damaged file", "from", from+1, "damaged_dir", st.Dir, "error", err)
		}
	}
	b, _ := json.Marshal(st)
	if err := d.db.PutMeta(metaLost, b); err != nil {
		d.log.Warn("recording the lost records failed", "error", err)
	}
	d.lost.Store(st)
	if err := os.Remove(filepath.Join(d.cfg.Node.DataDir, resyncFile)); err != nil {
		d.log.Warn("removing the re-sync record failed", "error", err)
	}
	switch {
	case len(st.Lost) > 0:
		d.log.Error("records this member held alone are lost: the damaged data file had them past the master's log and they cannot be read",
			"lost", rangesText(st.Lost, st.Survey), "master_last_index", from, "records_republished", requeued, "damaged_dir", st.Dir)
	case !st.Survey.Opened:
		d.log.Error("the damaged data file could not be read at all: whether it held records past the master's log is unknown", "master_last_index", from, "damaged_dir", st.Dir, "why", st.Survey.Why)
	default:
		d.log.Info("nothing acked was lost: the master's log holds every index the damaged data file could not read", "master_last_index", from, "records_republished", requeued, "damaged_dir", st.Dir)
	}
	d.log.Info("rejoined the cluster after the damage; replaying the master's log", "master", r.Master, "cluster", st.Known.Cluster)
}

// lostPast returns the unreadable index ranges of the damaged log past
// from: what the cluster does not have and this member cannot give back.
func lostPast(s storage.Survey, from uint64) []storage.IndexRange {
	var out []storage.IndexRange
	for _, r := range s.Unreadable {
		if r.Last > from {
			out = append(out, storage.IndexRange{First: max(r.First, from+1), Last: r.Last})
		}
	}
	return out
}

// loadLost reads what an earlier re-sync lost, for status.
func (d *Daemon) loadLost() error {
	b, err := d.db.GetMeta(metaLost)
	if err != nil || len(b) == 0 {
		return err
	}
	var st resyncState
	if err := json.Unmarshal(b, &st); err != nil {
		d.log.Warn("the record of an earlier re-sync is unreadable", "error", err)
		return nil
	}
	d.lost.Store(&st)
	return nil
}

// damageStatus fills status's storage.lost and storage.damaged.
func (d *Daemon) damageStatus(s *admin.StatusStorage) {
	s.Lost = []admin.StatusRange{}
	st := d.lost.Load()
	if st == nil {
		st = d.resync
	}
	if st == nil {
		return
	}
	for _, r := range st.Lost {
		s.Lost = append(s.Lost, admin.StatusRange{First: r.First, Last: r.Last})
	}
	dm := &admin.StatusDamaged{Dir: st.Dir, At: st.At, Error: st.Error, Opened: st.Survey.Opened, Unreadable: []admin.StatusRange{}, Resyncing: !st.Done}
	for _, r := range st.Survey.Unreadable {
		dm.Unreadable = append(dm.Unreadable, admin.StatusRange{First: r.First, Last: r.Last})
	}
	s.Damaged = dm
}

// syncDirs makes the renames in dirs durable.
func syncDirs(dirs ...string) {
	for _, p := range dirs {
		if f, err := os.Open(p); err == nil {
			_ = f.Sync()
			f.Close()
		}
	}
}
