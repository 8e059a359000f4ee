package discovery

import (
	"context"
	"fmt"
	"net"
	"reflect"
	"sync"

	"github.com/godbus/dbus/v5"
)

// avahi-daemon's D-Bus API (avahi-daemon/org.freedesktop.Avahi.*.xml).
const (
	avahiName     = "org.freedesktop.Avahi"
	avahiServer   = avahiName + ".Server"
	avahiGroupIf  = avahiName + ".EntryGroup"
	avahiBrowseIf = avahiName + ".ServiceBrowser"

	avahiIfUnspec    = int32(-1)
	avahiProtoUnspec = int32(-1)

	avahiStateCollision = 3
	avahiStateFailure   = 4
)

// avahiConn connects to the system bus (DBUS_SYSTEM_BUS_ADDRESS if set)
// and returns the connection if avahi-daemon is on it, else nil.
func avahiConn(ctx context.Context) *dbus.Conn {
	conn, err := dbus.ConnectSystemBus(dbus.WithContext(ctx))
	if err != nil {
		return nil
	}
	var has bool
	if err := conn.BusObject().CallWithContext(ctx, "org.freedesktop.DBus.NameHasOwner", 0, avahiName).Store(&has); err != nil || !has {
		conn.Close()
		return nil
	}
	return conn
}

// avahiIface is avahi's interface index for ifi (avahi uses the kernel's).
func avahiIface(ifi *net.Interface) int32 {
	if ifi == nil {
		return avahiIfUnspec
	}
	return int32(ifi.Index)
}

// avahiGroup is our entry group in avahi-daemon: both services, kept
// current by update, renamed on a collision, freed (goodbye) by close.
type avahiGroup struct {
	conn  *dbus.Conn
	cfg   Config
	iface int32
	sigs  chan *dbus.Signal
	done  chan struct{}
	wg    sync.WaitGroup

	mu   sync.Mutex      // guards path, name and last, and orders calls on the group
	path dbus.ObjectPath // our entry group; a new one after avahi restarts
	name string          // instance name; avahi may have us pick another
	last Info            // what the group holds now
}

func newAvahiGroup(conn *dbus.Conn, cfg Config, ifi *net.Interface) (*avahiGroup, error) {
	g := &avahiGroup{conn: conn, cfg: cfg, iface: avahiIface(ifi),
		sigs: make(chan *dbus.Signal, 16), done: make(chan struct{})}
	// Subscribe before the group exists so no StateChanged is missed.
	conn.Signal(g.sigs)
	if err := conn.AddMatchSignal(dbus.WithMatchInterface(avahiGroupIf), dbus.WithMatchMember("StateChanged")); err != nil {
		return nil, fmt.Errorf("discovery: avahi: %w", err)
	}
	// A restarted avahi-daemon has forgotten our group: watch for it.
	if err := conn.AddMatchSignal(dbus.WithMatchSender("org.freedesktop.DBus"), dbus.WithMatchMember("NameOwnerChanged"),
		dbus.WithMatchArg(0, avahiName)); err != nil {
		return nil, fmt.Errorf("discovery: avahi: %w", err)
	}
	if err := conn.Object(avahiName, "/").Call(avahiServer+".EntryGroupNew", 0).Store(&g.path); err != nil {
		return nil, fmt.Errorf("discovery: avahi EntryGroupNew: %w", err)
	}
	info := cfg.Info()
	g.name = instanceName(cfg, info)
	if err := g.publishLocked(info); err != nil {
		g.call("Free")
		return nil, err
	}
	g.wg.Add(1)
	go g.watch()
	return g, nil
}

func (g *avahiGroup) instance() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.name
}

func (g *avahiGroup) call(method string, args ...any) error {
	return g.conn.Object(avahiName, g.path).Call(avahiGroupIf+"."+method, 0, args...).Err
}

// publishLocked (re)fills the group from info and commits it.
func (g *avahiGroup) publishLocked(info Info) error {
	if err := g.call("Reset"); err != nil {
		return fmt.Errorf("discovery: avahi Reset: %w", err)
	}
	add := func(service string, port int, txt []string) error {
		err := g.call("AddService", g.iface, avahiProtoUnspec, uint32(0), g.name, service, "", "", uint16(port), txtBytes(txt))
		if err != nil {
			return fmt.Errorf("discovery: avahi AddService %s: %w", service, err)
		}
		return nil
	}
	if info.PeerPort > 0 {
		if err := add(ServicePeers, info.PeerPort, txt(info)); err != nil {
			return err
		}
	}
	if info.MQTTPort > 0 {
		if err := add(ServiceMQTT, info.MQTTPort, []string{TXTID + "=" + info.ID}); err != nil {
			return err
		}
	}
	g.last = info
	if info.PeerPort == 0 && info.MQTTPort == 0 {
		return nil // avahi refuses to commit an empty group
	}
	if err := g.call("Commit"); err != nil {
		return fmt.Errorf("discovery: avahi Commit: %w", err)
	}
	return nil
}

// update brings the group in line with Info(): a TXT update (announced by
// avahi at once) when only values changed, a re-registration when ports or
// the set of services did.
func (g *avahiGroup) update() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	info := g.cfg.Info()
	if reflect.DeepEqual(info, g.last) {
		return nil
	}
	if info.PeerPort == g.last.PeerPort && info.MQTTPort == g.last.MQTTPort && info.PeerPort > 0 {
		err := g.call("UpdateServiceTxt", g.iface, avahiProtoUnspec, uint32(0), g.name, ServicePeers, "", txtBytes(txt(info)))
		if err == nil {
			g.last = info
			return nil
		}
		g.cfg.Logger.Debug("mdns: avahi UpdateServiceTxt failed; registering again", "err", err)
	}
	return g.publishLocked(info)
}

// watch handles the group's state changes: on a name collision (another
// host has our instance name) it takes avahi's alternative name ("gw-1 #2");
// when avahi-daemon comes back after a restart it registers again.
func (g *avahiGroup) watch() {
	defer g.wg.Done()
	for {
		select {
		case <-g.done:
			return
		case s, ok := <-g.sigs:
			if !ok {
				return
			}
			if s.Name == "org.freedesktop.DBus.NameOwnerChanged" {
				if len(s.Body) == 3 && s.Body[0] == avahiName && s.Body[2] != "" {
					g.restarted()
				}
				continue
			}
			g.mu.Lock()
			ours := s.Path == g.path
			g.mu.Unlock()
			if !ours || len(s.Body) < 1 {
				continue
			}
			state, _ := s.Body[0].(int32)
			switch state {
			case avahiStateCollision:
				g.rename()
			case avahiStateFailure:
				g.cfg.Logger.Warn("mdns: avahi could not publish our services", "detail", s.Body)
			}
		}
	}
}

// restarted registers our services with a new avahi-daemon.
func (g *avahiGroup) restarted() {
	g.mu.Lock()
	defer g.mu.Unlock()
	var path dbus.ObjectPath
	if err := g.conn.Object(avahiName, "/").Call(avahiServer+".EntryGroupNew", 0).Store(&path); err != nil {
		g.cfg.Logger.Warn("mdns: avahi-daemon restarted; cannot register again", "err", err)
		return
	}
	g.path = path
	if err := g.publishLocked(g.cfg.Info()); err != nil {
		g.cfg.Logger.Warn("mdns: avahi-daemon restarted; cannot register again", "err", err)
		return
	}
	g.cfg.Logger.Info("mdns: avahi-daemon restarted; services registered again")
}

func (g *avahiGroup) rename() {
	g.mu.Lock()
	defer g.mu.Unlock()
	var alt string
	if err := g.conn.Object(avahiName, "/").Call(avahiServer+".GetAlternativeServiceName", 0, g.name).Store(&alt); err != nil {
		g.cfg.Logger.Warn("mdns: avahi name collision, no alternative", "name", g.name, "err", err)
		return
	}
	g.cfg.Logger.Warn("mdns: service name taken on the LAN, using another", "name", g.name, "new", alt)
	g.name = alt
	if err := g.publishLocked(g.cfg.Info()); err != nil {
		g.cfg.Logger.Warn("mdns: avahi re-register failed", "err", err)
	}
}

// close frees the group (avahi sends goodbye packets) and hangs up.
func (g *avahiGroup) close() error {
	close(g.done)
	g.wg.Wait()
	g.mu.Lock()
	err := g.call("Free")
	g.mu.Unlock()
	g.conn.RemoveSignal(g.sigs)
	if cerr := g.conn.Close(); err == nil {
		err = cerr
	}
	return err
}

func txtBytes(t []string) [][]byte {
	out := make([][]byte, len(t))
	for i, s := range t {
		out[i] = []byte(s)
	}
	return out
}

// browseAvahi asks avahi-daemon for the _tandem._tcp services on the LAN
// and resolves each, until ctx ends.
func browseAvahi(ctx context.Context, conn *dbus.Conn, ifi *net.Interface, logf func(string, ...any)) []Peer {
	sigs := make(chan *dbus.Signal, 64)
	conn.Signal(sigs)
	defer conn.RemoveSignal(sigs)
	// Subscribed before the browser exists: avahi may emit ItemNew before
	// ServiceBrowserNew has returned its path; godbus queues them for us.
	if err := conn.AddMatchSignal(dbus.WithMatchInterface(avahiBrowseIf)); err != nil {
		logf("avahi AddMatch", "err", err)
		return nil
	}
	srv := conn.Object(avahiName, "/")
	var path dbus.ObjectPath
	iface := avahiIface(ifi)
	if err := srv.CallWithContext(ctx, avahiServer+".ServiceBrowserNew", 0, iface, avahiProtoUnspec, ServicePeers, "", uint32(0)).Store(&path); err != nil {
		logf("avahi ServiceBrowserNew", "err", err)
		return nil
	}
	defer conn.Object(avahiName, path).Call(avahiBrowseIf+".Free", 0)

	var (
		mu    sync.Mutex // guards found
		found []Peer
		wg    sync.WaitGroup
	)
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return found
		case s := <-sigs:
			if s.Path != path || s.Name != avahiBrowseIf+".ItemNew" {
				continue
			}
			var (
				ifidx, proto      int32
				name, typ, domain string
				flags             uint32
			)
			if err := dbus.Store(s.Body, &ifidx, &proto, &name, &typ, &domain, &flags); err != nil {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				if p, ok := resolveAvahi(ctx, srv, ifidx, proto, name, typ, domain, logf); ok {
					mu.Lock()
					found = append(found, p)
					mu.Unlock()
				}
			}()
		}
	}
}

// resolveAvahi resolves one service avahi found (SRV, TXT, address).
func resolveAvahi(ctx context.Context, srv dbus.BusObject, ifidx, proto int32, name, typ, domain string, logf func(string, ...any)) (Peer, bool) {
	var (
		rIf, rProto, aProto         int32
		rName, rType, rDomain, host string
		addr                        string
		port                        uint16
		txt                         [][]byte
		flags                       uint32
	)
	err := srv.CallWithContext(ctx, avahiServer+".ResolveService", 0, ifidx, proto, name, typ, domain, proto, uint32(0)).
		Store(&rIf, &rProto, &rName, &rType, &rDomain, &host, &aProto, &addr, &port, &txt, &flags)
	if err != nil {
		logf("avahi resolve", "name", name, "err", err)
		return Peer{}, false
	}
	fields := make([]string, len(txt))
	for i, t := range txt {
		fields[i] = string(t)
	}
	p, err := parseTXT(fields)
	if err != nil {
		logf("ignoring a peer", "name", name, "err", err)
		return Peer{}, false
	}
	ip := net.ParseIP(addr)
	if ip == nil {
		return Peer{}, false
	}
	zone := ""
	if i, err := net.InterfaceByIndex(int(rIf)); err == nil {
		zone = i.Name
	}
	p.Addrs = []string{hostPort(ip, zone, int(port))}
	return p, true
}
