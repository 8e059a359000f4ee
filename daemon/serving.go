package daemon

import (
	"errors"
	"net"
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
//     them as such (README: its devices may stay connected throughout),
//     while sending them away would end a clean session's subscriptions;
//   - a member of a cluster that has seen no master for longer than
//     leaderlessFor sends them to the other members if the cluster has
//     three voters, one of which may lead a majority elsewhere; a 2-gateway
//     slave whose master is gone has nobody to send them to, and keeps
//     them. A member forgets its master only once an election timeout
//     passes without it (a master cut off from the majority steps down
//     then, check-quorum), and an election settles within a few hundred
//     milliseconds after that: a second more without one means none is in
//     reach. A master knows sooner: once it has heard from no majority of
//     the voters for an election timeout (replication's CutOff), it sends
//     its devices to the others cutOffFor later, rather than at
//     check-quorum's next look (one to two election timeouts) plus that
//     second;
//   - a gateway whose disk is below storage.min_free, or whose log is full
//     of what a member lacks, cannot log publishes itself. As a slave it
//     needs not: its devices' publishes go to the master on the forward
//     stream, so it serves them (200) and keeps its subscribers. As the
//     master it hands the mastership to a voter that can write
//     (replication/handoff.go) and serves again once that one leads;
//     until then, or when no member can take it (a 2-gateway slave is a
//     learner), it answers 503 with the reason and keeps its devices,
//     since the others send every publish to it;
//   - a gateway whose log writes fail (its raft loop retries the save)
//     applies nothing either, so its subscribers get nothing: it sends
//     its devices to the master, or, as a master of three voters (the
//     others elect a new one once its heartbeats stop), to the others.

// servingEvery is how often the watch looks; leaderlessFor how long a
// member of a cluster may see no master before it sends its devices away.
const (
	servingEvery  = 200 * time.Millisecond
	leaderlessFor = time.Second
)

// cutOffFor is how long a master must have known itself cut off before it
// sends its devices away: a shorter blip of the LAN, or peers stalled for
// a moment, costs them nothing.
const cutOffFor = 500 * time.Millisecond

// cutOffReason is why a member cut off from the majority sends its
// devices away: one text whichever way it found out, so the devices are
// told once.
const cutOffReason = "no master reachable: cut off from the cluster's majority"

// servingWatch is the state of the watch.
type servingWatch struct {
	why   atomic.Pointer[string] // nil while the gateway takes publishes
	stopc chan struct{}
	done  chan struct{}

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

// startServingWatch starts the watch; stopServingWatch ends it.
func (d *Daemon) startServingWatch() {
	d.serving.stopc, d.serving.done = make(chan struct{}), make(chan struct{})
	go d.watchServing()
}

// stopServingWatch ends the watch and waits for it.
func (d *Daemon) stopServingWatch() {
	if d.serving.stopc == nil {
		return
	}
	close(d.serving.stopc)
	<-d.serving.done
}

func (d *Daemon) watchServing() {
	defer close(d.serving.done)
	t := time.NewTicker(servingEvery)
	defer t.Stop()
	var leaderless time.Time
	for {
		select {
		case <-d.serving.stopc:
			return
		case <-t.C:
		}
		now := time.Now()
		if n := d.gw.Node(); n != nil {
			d.noteLinks(n, now)
		}
		why, ref := d.checkServing(&leaderless, now)
		old := d.serving.why.Load()
		switch {
		case why == "" && old != nil:
			d.serving.why.Store(nil)
			d.log.Info("taking publishes again", "was", *old)
		case why != "" && (old == nil || *old != why):
			d.serving.why.Store(&why)
			d.log.Warn("not taking publishes", "reason", why, "devices_sent_to", ref)
		}
		d.broker.Redirect(ref, why) // "" ref: keep the devices
	}
}

// checkServing says why the gateway cannot take publishes ("" when it can)
// and where its devices should go ("" to keep them). leaderless is when
// the member last saw no master, zero while it sees one.
func (d *Daemon) checkServing(leaderless *time.Time, now time.Time) (why, ref string) {
	n := d.gw.Node()
	if n == nil {
		return "starting", ""
	}
	members := n.Members()
	if n.Fenced() {
		return "replaced by a promoted master: rejoining as its slave", ""
	}
	if t := n.CutOff(); !t.IsZero() && now.Sub(t) >= cutOffFor {
		// A master that heard from no majority for an election timeout
		// and a bit: the others elect a new one meanwhile.
		return cutOffReason, d.mqttRefs(n, members)
	}
	if len(members) > 1 && n.Leader() == 0 {
		if leaderless.IsZero() {
			*leaderless = now
		}
		if now.Sub(*leaderless) > leaderlessFor {
			if voters(members) >= 3 {
				return cutOffReason, d.mqttRefs(n, members)
			}
			return "no master reachable", ""
		}
	} else {
		*leaderless = time.Time{}
	}
	if why := d.db.RefusingReason(); why != "" || n.SaveFailing() {
		return d.diskServing(n, members, why)
	}
	return "", ""
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
	if why := d.serving.why.Load(); why != nil {
		return errors.New(*why)
	}
	return nil
}
