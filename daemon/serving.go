package daemon

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tandem-edge/tandem/replication"
)

// Devices follow the master.
//
// A member that cannot take publishes says so: /healthz answers 503 with
// the reason, and, when another member can serve its devices, it sends
// them there (mqtt.Server.Redirect: MQTT 5 clients get 0x9C "use another
// server" with a Server Reference, 3.1.1 clients are disconnected and
// refused at CONNECT until it serves again). The watch looks every
// servingEvery:
//   - a fenced node (a promoted member replaced it) answers 503 but keeps
//     its devices: it is the new master's slave within seconds and serves
//     them as such (docs/clusters.md: its devices may stay connected throughout),
//     while sending them away would end a clean session's subscriptions;
//   - a member of a cluster that has seen no master for longer than
//     leaderlessFor sends them to the other members if the cluster has
//     three voters, one of which may lead a majority elsewhere; a 2-gateway
//     slave whose master is gone has nobody to send them to, and keeps
//     them. A member forgets its master only once its randomized
//     election timeout (one to two election timeouts) passes without it
//     (a master cut off from the majority steps down then, check-quorum),
//     and its pre-vote may then be refused by a member whose own timeout
//     has not run out yet (or whose log is longer), which campaigns itself
//     up to an election timeout later, or by then the first tries again,
//     up to two later: a member of the majority can be without a master
//     for about two election timeouts and a vote (CI saw 1.3 s with 1 s,
//     and its devices were sent away in the middle of an ordinary
//     failover, some to the very member that was cut off). So only
//     leaderlessTimeouts election timeouts without one mean none is in
//     reach. A master knows sooner: once it has heard from no majority of
//     the voters for an election timeout (replication's CutOff), it sends
//     its devices to the others cutOffFor later, rather than at
//     check-quorum's next look (one to two election timeouts) plus that
//     second;
//   - a member whose master (another one) is out of reach, its link down
//     or nothing heard from it for an election timeout, answers 503 "no
//     master reachable" at once and keeps its devices: their publishes
//     wait for a master and fail after sync_timeout. A 2-gateway slave is
//     a learner, which never campaigns: raft names its dead master for
//     ever, so Leader() alone never said so;
//   - a gateway whose disk is below storage.min_free, or whose log is full
//     of what a member lacks, cannot log publishes itself. As a slave it
//     needs not: its devices' publishes go to the master on the forward
//     stream, so it serves them (200) and keeps its subscribers. As the
//     master it hands the mastership to a voter that can write
//     (replication/handoff.go) and serves again once that one leads;
//     until then, or when no member can take it (a 2-gateway slave is a
//     learner), it answers 503 with the reason and keeps its devices,
//     since the others send every publish to it;
//   - a member whose broker state is incomplete (a snapshot's install was
//     interrupted: replication/incomplete.go) takes no devices at all,
//     since what it would serve them is part old, part new: it sends them
//     to the others, or, with none to name, refuses them
//     (mqtt.Server.Refuse: CONNACK 0x88, 3.1.1 0x03). A gateway with no
//     other member waits for a snapshot nobody will send: its reason
//     says how its operator accepts the state as it is instead;
//   - a gateway whose log writes fail (its raft loop retries the save)
//     applies nothing either, so its subscribers get nothing: it sends
//     its devices to the master, or, as a master of three voters (the
//     others elect a new one once its heartbeats stop), to the others.

// servingEvery is how often the watch looks at most (it looks every
// cluster.heartbeat when that is shorter); leaderlessTimeouts how many
// election timeouts a member of a cluster may see no master before it
// sends its devices away (leaderlessFor).
const (
	servingEvery       = 200 * time.Millisecond
	leaderlessTimeouts = 3
)

// leaderlessFor is how long a member of a cluster may see no master
// before it sends its devices away: leaderlessTimeouts election timeouts,
// and never less than a second.
func (d *Daemon) leaderlessFor() time.Duration {
	return max(time.Second, leaderlessTimeouts*d.cfg.Cluster.ElectionTimeout.Duration())
}

// cutOffFor is how long a master must have known itself cut off before it
// sends its devices away: a shorter blip of the LAN, or peers stalled for
// a moment, costs them nothing.
const cutOffFor = 500 * time.Millisecond

// cutOffReason is why a member cut off from the majority sends its
// devices away: one text whichever way it found out, so the devices are
// told once.
const cutOffReason = "no master reachable: cut off from the cluster's majority"

// incompleteReason is why a member whose broker state is incomplete (a
// snapshot's install was interrupted) takes no devices: it sends them to
// the other members, or refuses them when it can name none.
const incompleteReason = "broker state incomplete: a snapshot's install was interrupted, waiting for the master to send it again"

// incompleteAlone is incompleteReason for a gateway with no other member:
// no snapshot will ever come, and only its operator can end the wait
// (tandem repair --accept-incomplete, docs/storage.md). What follows the
// "; " is for the operator, not the devices (deviceReason).
const incompleteAlone = "broker state incomplete: a snapshot's install was interrupted and this gateway has no other member to send it again; " +
	"to serve the state as it is (part old, part new), stop the gateway and run `tandem repair --accept-incomplete --data %s`"

// deviceReason is the part of why that devices are told: up to the first
// "; ", after which come hints for the operator.
func deviceReason(why string) string {
	why, _, _ = strings.Cut(why, "; ")
	return why
}

// servingState is what the watch last found: the one answer to "does this
// member take publishes" that /healthz, the status JSON, the status page
// and `tandem status` all read, so they never disagree. Which master they
// name is reachableMaster's rule, the one the watch applies.
type servingState struct {
	why string // "" while the gateway takes publishes, else why not
}

// startingState is the state until the watch's first look.
var startingState = &servingState{why: "starting"}

// servingWatch is the state of the watch.
type servingWatch struct {
	state    atomic.Pointer[servingState] // nil before Start: starting
	stopping atomic.Bool                  // Stop began: the state stays "stopping"
	stopc    chan struct{}
	done     chan struct{}

	downMu sync.Mutex           // guards down
	down   map[uint64]time.Time // members without a link, since when
}

// noteLinks records which members this gateway has lost its link to, and
// since when: status's down_since.
func (d *Daemon) noteLinks(n *replication.Node, now time.Time) {
	w := &d.serving
	w.downMu.Lock()
	defer w.downMu.Unlock()
	if w.down == nil {
		w.down = map[uint64]time.Time{}
	}
	seen := map[uint64]bool{}
	for _, m := range n.Members() {
		if m.ID == n.ID() {
			continue
		}
		seen[m.ID] = true
		if d.gw.Reachable(m.ID) {
			delete(w.down, m.ID)
		} else if _, ok := w.down[m.ID]; !ok {
			w.down[m.ID] = now
		}
	}
	for id := range w.down {
		if !seen[id] {
			delete(w.down, id)
		}
	}
}

// downSince is when the link to member id was lost; ok is false while it
// is up (or not yet looked at).
func (d *Daemon) downSince(id uint64) (t time.Time, ok bool) {
	d.serving.downMu.Lock()
	defer d.serving.downMu.Unlock()
	t, ok = d.serving.down[id]
	return t, ok
}

// startServingWatch starts the watch, which looks once before it
// returns; stopServingWatch ends it.
func (d *Daemon) startServingWatch() {
	d.serving.stopc, d.serving.done = make(chan struct{}), make(chan struct{})
	every := servingEvery
	if hb := d.cfg.Cluster.Heartbeat.Duration(); hb > 0 {
		// Health follows its cause within one heartbeat.
		every = min(every, hb)
	}
	var leaderless time.Time
	d.lookServing(&leaderless)
	go d.watchServing(every, leaderless)
}

// markStopping makes the state "stopping" for good: Stop's first step,
// while the HTTP listener still answers.
func (d *Daemon) markStopping() {
	d.serving.stopping.Store(true)
	d.serving.state.Store(&servingState{why: "stopping"})
}

// stopServingWatch ends the watch and waits for it.
func (d *Daemon) stopServingWatch() {
	if d.serving.stopc == nil {
		return
	}
	close(d.serving.stopc)
	<-d.serving.done
}

func (d *Daemon) watchServing(every time.Duration, leaderless time.Time) {
	defer close(d.serving.done)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-d.serving.stopc:
			return
		case <-t.C:
		}
		d.lookServing(&leaderless)
	}
}

// lookServing is one look of the watch: it stores what it found, logs a
// change, and sends the devices away or keeps them.
func (d *Daemon) lookServing(leaderless *time.Time) {
	now := time.Now()
	if n := d.gw.Node(); n != nil {
		d.noteLinks(n, now)
	}
	why, ref, refuse := d.checkServing(leaderless, now)
	if d.serving.stopping.Load() {
		return
	}
	st := &servingState{why: why}
	old := d.servingNow()
	d.serving.state.Store(st)
	switch {
	case why == "" && old.why != "":
		d.log.Info("taking publishes again", "was", old.why)
	case why != "" && old.why != why:
		d.log.Warn("not taking publishes", "reason", why, "devices_sent_to", ref)
	}
	d.sendDevices(why, ref, refuse)
}

// sendDevices sends the devices to ref, refuses them (refuse, no member to
// name), or keeps them: checkServing's finding, told to the broker.
func (d *Daemon) sendDevices(why, ref string, refuse bool) {
	switch {
	case ref != "":
		d.broker.Redirect(ref, deviceReason(why))
	case refuse:
		d.broker.Refuse(deviceReason(why))
	default:
		d.broker.Serve()
	}
}

// servingNow is the watch's last finding ("starting" before its first).
func (d *Daemon) servingNow() *servingState {
	if st := d.serving.state.Load(); st != nil {
		return st
	}
	return startingState
}

// reachableMaster is the master to name: this member while it leads and is
// not cut off, another while its link is up and it was heard within an
// election timeout; 0 for none. why is checkServing's finding.
func (d *Daemon) reachableMaster(why string) uint64 {
	n := d.gw.Node()
	if n == nil || n.Fenced() || why == cutOffReason {
		return 0
	}
	switch lead := n.Leader(); {
	case lead == 0 || lead == n.ID():
		return lead
	case d.gw.Reachable(lead) && !n.MasterSilent():
		return lead
	}
	return 0
}

// checkServing says why the gateway cannot take publishes ("" when it can)
// and where its devices should go ("" to keep them, unless refuse: what it
// would serve them is wrong, and they are refused even with no member to
// send them to). leaderless is when the member last saw no master, zero
// while it sees one.
func (d *Daemon) checkServing(leaderless *time.Time, now time.Time) (why, ref string, refuse bool) {
	n := d.gw.Node()
	if n == nil {
		return "starting", "", false
	}
	members := n.Members()
	if n.Fenced() {
		return "replaced by a promoted master: rejoining as its slave", "", false
	}
	if n.StateIncomplete() {
		why, ref := d.incompleteServing(n, members)
		return why, ref, true
	}
	why, ref = d.checkWhole(n, members, leaderless, now)
	return why, ref, false
}

// incompleteServing is checkServing for a member whose broker state is
// incomplete: its retained messages, sessions and cursors are part old,
// part new, and a device served them would see both (a retained message
// older than one it saw, a session missing its subscriptions). The devices
// go to the others until the master's snapshot is installed
// (replication/incomplete.go), or are refused when there is nobody to
// name; the reason says what the operator can do when no other member
// exists.
func (d *Daemon) incompleteServing(n *replication.Node, members []replication.Member) (why, ref string) {
	if len(members) <= 1 {
		dir := d.cfg.Node.DataDir
		if abs, err := filepath.Abs(dir); err == nil {
			dir = abs
		}
		return fmt.Sprintf(incompleteAlone, dir), ""
	}
	return incompleteReason, d.mqttRefs(n, members)
}

// checkWhole is checkServing for a member whose broker state is whole:
// while it cannot take publishes it still serves what it holds, so with
// nobody to name its devices stay.
func (d *Daemon) checkWhole(n *replication.Node, members []replication.Member, leaderless *time.Time, now time.Time) (why, ref string) {
	if t := n.CutOff(); !t.IsZero() && now.Sub(t) >= cutOffFor {
		// A master that heard from no majority for an election timeout
		// and a bit: the others elect a new one meanwhile.
		return cutOffReason, d.mqttRefs(n, members)
	}
	if len(members) > 1 && n.Leader() == 0 {
		if leaderless.IsZero() {
			*leaderless = now
		}
		if now.Sub(*leaderless) > d.leaderlessFor() {
			if voters(members) >= 3 {
				return cutOffReason, d.mqttRefs(n, members)
			}
			return "no master reachable", ""
		}
	} else {
		*leaderless = time.Time{}
	}
	if why := d.unreachableMaster(n, members); why != "" {
		// Its devices keep it: their publishes wait for a master
		// (sync_timeout), and a voter elects one or the leaderless rule
		// above sends them away.
		return why, ""
	}
	if why := d.db.RefusingReason(); why != "" || n.SaveFailing() {
		return d.diskServing(n, members, why)
	}
	return "", ""
}

// unreachableMaster says why the master this member names, another one,
// is out of reach ("" while it is in reach, or none is named): the link to
// it is down (a killed master: the kernel closes the connection at once),
// or it sent nothing for an election timeout (a cut cable: the link lasts
// until the transport's idle timeout). Publishes then wait for a master
// and fail after sync_timeout: the gateway does not take them.
func (d *Daemon) unreachableMaster(n *replication.Node, members []replication.Member) string {
	lead := n.Leader()
	if lead == 0 || lead == n.ID() {
		return ""
	}
	name := replication.ShortID(lead)
	for _, m := range members {
		if m.ID == lead && m.Name != "" {
			name = m.Name
		}
	}
	var why string
	switch {
	case !d.gw.Reachable(lead):
		why = "no master reachable: the link to " + name + " is down"
	case n.MasterSilent():
		why = "no master reachable: nothing heard from " + name + " for an election timeout"
	default:
		return ""
	}
	if voters(members) < 2 && d.cfg.Cluster.Failover != "auto" {
		// A 2-gateway slave (a learner): nobody else will lead.
		why += "; `tandem promote` on this gateway makes it the master"
	}
	return why
}

// diskServing is checkServing for a gateway whose own log refuses
// records, why saying so ("" when only its saves fail).
func (d *Daemon) diskServing(n *replication.Node, members []replication.Member, why string) (string, string) {
	if why == "" {
		why = "disk: writing the log fails; retrying"
	}
	lead := n.Leader()
	away := lead != 0 && lead != n.ID() && d.gw.Reachable(lead)
	if n.SaveFailing() {
		if away || (lead == n.ID() && voters(members) >= 3) {
			return why, d.mqttRefs(n, members)
		}
		return why, ""
	}
	if away {
		return "", "" // publishes go to the master on the forward stream
	}
	if _, stuck := n.Handoff(); stuck != "" {
		why += "; " + stuck
	}
	return why, ""
}

// voters counts the voters among members.
func voters(members []replication.Member) int {
	n := 0
	for _, m := range members {
		if m.Voter {
			n++
		}
	}
	return n
}

// mqttRefs names the other members' MQTT listeners for a Server
// Reference: each member's host (from its peer address) with this
// gateway's MQTT port, space-separated (MQTT 5 §4.11). Members are
// expected to listen for devices on the same port.
func (d *Daemon) mqttRefs(n *replication.Node, members []replication.Member) string {
	_, port, err := net.SplitHostPort(d.broker.Addr())
	if err != nil {
		return ""
	}
	var refs []string
	for _, m := range members {
		if m.ID == n.ID() || len(m.Addrs) == 0 {
			continue
		}
		if host, _, err := net.SplitHostPort(m.Addrs[0]); err == nil {
			refs = append(refs, net.JoinHostPort(host, port))
		}
	}
	return strings.Join(refs, " ")
}

// notServing is why the gateway cannot take publishes, nil while it can:
// /healthz and the status page.
func (d *Daemon) notServing() error {
	if err := d.Err(); err != nil {
		return err
	}
	if why := d.servingNow().why; why != "" {
		return errors.New(why)
	}
	return nil
}
