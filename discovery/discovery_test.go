package discovery

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/mdns"
	"github.com/miekg/dns"
)

func testInfo() Info {
	return Info{ID: "a1b2c3d4e5f60718", Name: "gw-1", Cluster: "c0ffee", Role: "master", Version: "v1.2.3",
		Gen: 2, Term: 7, PeerPort: 7883, MQTTPort: 1883, PairOpen: true}
}

func TestTXTRoundTrip(t *testing.T) {
	for _, info := range []Info{testInfo(), {ID: "0000000000000001"}} {
		p, err := parseTXT(txt(info))
		if err != nil {
			t.Fatal(err)
		}
		want := Peer{ID: info.ID, Name: info.Name, Cluster: info.Cluster, Gen: info.Gen, Role: info.Role,
			Term: info.Term, MQTTPort: info.MQTTPort, Version: info.Version, PairOpen: info.PairOpen}
		if !reflect.DeepEqual(p, want) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", p, want)
		}
	}
	if got := strings.Join(txt(testInfo()), " "); got != "id=a1b2c3d4e5f60718 name=gw-1 cluster=c0ffee gen=2 role=master term=7 mqtt=1883 ver=v1.2.3 pair=open" {
		t.Fatalf("TXT %q", got)
	}
}

// TXT from the LAN is untrusted: odd records are refused, never a panic;
// keys are case-insensitive and the first occurrence wins (RFC 6763 6.4).
func TestParseTXTFromTheLAN(t *testing.T) {
	bad := [][]string{
		nil,
		{"name=gw"},                           // no id
		{"id="},                               // empty id
		{"id=1", "gen=-1"},                    // not a number
		{"id=1", "term=99999999999999999999"}, // overflow
		{"id=1", "mqtt=70000"},                // not a port
		{"id=1", "name=a\x00b"},               // control character
		{"id=1", "name=\xff\xfe"},             // not UTF-8
		{"id=1", "name=" + strings.Repeat("x", maxValue+1)},
	}
	for _, f := range bad {
		if p, err := parseTXT(f); !errors.Is(err, errBadTXT) {
			t.Errorf("parseTXT(%q) = %+v, %v; want errBadTXT", f, p, err)
		}
	}
	p, err := parseTXT([]string{"ID=x", "id=y", "name", "=zz", "future=1", "Term=4", "pair=closed"})
	if err != nil {
		t.Fatal(err)
	}
	if p.ID != "x" || p.Term != 4 || p.Name != "" || p.PairOpen {
		t.Fatalf("got %+v", p)
	}
}

func FuzzParseTXT(f *testing.F) {
	f.Add(strings.Join(txt(testInfo()), "\x00"))
	f.Add("id=1\x00gen=x")
	f.Add("\x00=\x00id")
	f.Fuzz(func(t *testing.T, s string) {
		p, err := parseTXT(strings.Split(s, "\x00"))
		if err != nil {
			return
		}
		// What we accept we can say again and read back the same.
		info := Info{ID: p.ID, Name: p.Name, Cluster: p.Cluster, Role: p.Role, Version: p.Version,
			Gen: p.Gen, Term: p.Term, MQTTPort: p.MQTTPort, PairOpen: p.PairOpen}
		q, err := parseTXT(txt(info))
		if err != nil || !reflect.DeepEqual(p, q) {
			t.Fatalf("re-encoded %+v: %+v, %v", p, q, err)
		}
	})
}

// liveZone is a zone over an Info the test changes.
func liveZone() (*zone, func(func(*Info))) {
	var mu sync.Mutex
	info := testInfo()
	z := &zone{
		cfg: Config{Info: func() Info {
			mu.Lock()
			defer mu.Unlock()
			return info
		}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		addrs: func(*net.Interface) []net.IP { return []net.IP{net.ParseIP("198.51.100.7")} },
	}
	return z, func(f func(*Info)) { mu.Lock(); f(&info); mu.Unlock() }
}

// ask sends q through the zone and a DNS wire round trip, as a peer's
// hashicorp/mdns client would read it.
func ask(t *testing.T, z *zone, name string, qtype uint16) []dns.RR {
	t.Helper()
	m := &dns.Msg{Answer: z.Records(dns.Question{Name: name, Qtype: qtype, Qclass: dns.ClassINET})}
	b, err := m.Pack()
	if err != nil {
		t.Fatal(err)
	}
	var back dns.Msg
	if err := back.Unpack(b); err != nil {
		t.Fatal(err)
	}
	return back.Answer
}

func txtOf(rrs []dns.RR) []string {
	for _, rr := range rrs {
		if t, ok := rr.(*dns.TXT); ok && strings.HasSuffix(t.Hdr.Name, peerSuffix) {
			return t.Txt
		}
	}
	return nil
}

func TestZoneAnswersFromLiveInfo(t *testing.T) {
	z, change := liveZone()
	rrs := ask(t, z, ServicePeers+".local.", dns.TypePTR)
	var srv *dns.SRV
	var a *dns.A
	for _, rr := range rrs {
		switch r := rr.(type) {
		case *dns.SRV:
			srv = r
		case *dns.A:
			a = r
		}
		if rr.Header().Ttl != ttl {
			t.Errorf("%s: TTL %d, want %d", rr, rr.Header().Ttl, ttl)
		}
	}
	if srv == nil || srv.Port != 7883 || srv.Hdr.Name != "gw-1"+peerSuffix || srv.Target != "tandem-a1b2c3d4e5f60718.local." {
		t.Fatalf("SRV %v", srv)
	}
	if a == nil || a.A.String() != "198.51.100.7" {
		t.Fatalf("A %v", a)
	}
	if p, err := parseTXT(txtOf(rrs)); err != nil || p.Term != 7 || p.Role != "master" || !p.PairOpen {
		t.Fatalf("TXT %+v %v", p, err)
	}

	change(func(i *Info) { i.Term, i.Role, i.Gen, i.PairOpen = 8, "slave", 3, false })
	rrs = ask(t, z, "gw-1"+peerSuffix, dns.TypeTXT)
	if p, err := parseTXT(txtOf(rrs)); err != nil || p.Term != 8 || p.Role != "slave" || p.Gen != 3 || p.PairOpen {
		t.Fatalf("after the change: TXT %+v %v", p, err)
	}

	// _mqtt._tcp follows MQTTPort, and goes away with it.
	if rrs := ask(t, z, ServiceMQTT+".local.", dns.TypePTR); len(rrs) == 0 {
		t.Fatal("no _mqtt._tcp answer")
	}
	change(func(i *Info) { i.MQTTPort = 0 })
	if rrs := ask(t, z, ServiceMQTT+".local.", dns.TypePTR); len(rrs) != 0 {
		t.Fatalf("_mqtt._tcp still answered: %v", rrs)
	}
	// The host name is answered once, not once per service.
	change(func(i *Info) { i.MQTTPort = 1883 })
	if rrs := ask(t, z, "tandem-a1b2c3d4e5f60718.local.", dns.TypeA); len(rrs) != 1 {
		t.Fatalf("A answers %v", rrs)
	}
	// Other names: nothing.
	if rrs := ask(t, z, "_http._tcp.local.", dns.TypePTR); len(rrs) != 0 {
		t.Fatalf("answered %v", rrs)
	}
}

func TestFromEntry(t *testing.T) {
	logf := func(string, ...any) {}
	e := &mdns.ServiceEntry{Name: "gw-1" + peerSuffix, AddrV4: net.ParseIP("198.51.100.1"), Port: 7883, InfoFields: txt(testInfo())}
	p, ok := fromEntry(e, logf)
	if !ok || p.ID != testInfo().ID || !reflect.DeepEqual(p.Addrs, []string{"198.51.100.1:7883"}) {
		t.Fatalf("%+v %v", p, ok)
	}
	for _, bad := range []*mdns.ServiceEntry{
		{Name: "gw-1._http._tcp.local.", AddrV4: e.AddrV4, Port: 80, InfoFields: e.InfoFields}, // another service
		{Name: e.Name, AddrV4: e.AddrV4, Port: 7883, InfoFields: []string{"id=1", "gen=x"}},    // bad TXT
		{Name: e.Name, AddrV4: e.AddrV4, InfoFields: e.InfoFields},                             // no port
	} {
		if p, ok := fromEntry(bad, logf); ok {
			t.Errorf("accepted %+v as %+v", bad, p)
		}
	}
}

func TestMerge(t *testing.T) {
	got := merge([]Peer{
		{ID: "b", Name: "gw-2", Term: 1, Addrs: []string{"198.51.100.2:7883"}},
		{ID: "a", Name: "gw-1", Addrs: []string{"198.51.100.1:7883"}},
		{ID: "b", Name: "gw-2", Term: 2, Addrs: []string{"198.51.100.12:7883", "198.51.100.2:7883"}},
		{ID: "c", Name: "gw-1"},
	})
	want := []Peer{
		{ID: "a", Name: "gw-1", Addrs: []string{"198.51.100.1:7883"}},
		{ID: "c", Name: "gw-1", Addrs: []string{}},
		{ID: "b", Name: "gw-2", Term: 2, Addrs: []string{"198.51.100.12:7883", "198.51.100.2:7883"}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("merge:\n got %+v\nwant %+v", got, want)
	}
}

func TestInstanceName(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		info Info
		want string
	}{
		{Config{Instance: "x"}, Info{Name: "gw"}, "x"},
		{Config{}, Info{Name: "gw"}, "gw"},
		{Config{}, Info{ID: "a1b2c3d4e5f60718"}, "tandem-a1b2c3d4"},
	} {
		if got := instanceName(c.cfg, c.info); got != c.want {
			t.Errorf("instanceName(%+v, %+v) = %q, want %q", c.cfg, c.info, got, c.want)
		}
	}
	if got := dnsLabel("a.b\\c"); got != "a-b-c" {
		t.Errorf("dnsLabel %q", got)
	}
}

func TestAdvertiseNeedsInfo(t *testing.T) {
	if _, err := Advertise(Config{}); err == nil {
		t.Fatal("Advertise without Info succeeded")
	}
	if _, err := Advertise(Config{Info: testInfo, Interface: "no-such-if0"}); err == nil {
		t.Fatal("Advertise on a missing interface succeeded")
	}
}

// On a LAN without IPv6 the kernel opens a udp6 socket but refuses the
// send to ff02::fb; the mdns client then fails the whole query, IPv4
// included. Browse must drop IPv6 and find the gateway over IPv4, not
// report the refused send (pairing showed it where a wrong code was
// expected).
func TestBrowseOnAnIPv4OnlyLANAsksOverIPv4(t *testing.T) {
	refused := &net.OpError{Op: "write", Net: "udp6", Err: &os.SyscallError{Syscall: "sendto", Err: syscall.EADDRNOTAVAIL}}
	var calls []bool // DisableIPv6 of each query
	orig := mdnsQuery
	t.Cleanup(func() { mdnsQuery = orig })
	mdnsQuery = func(ctx context.Context, q *mdns.QueryParam) error {
		calls = append(calls, q.DisableIPv6)
		if !q.DisableIPv6 {
			return refused
		}
		q.Entries <- &mdns.ServiceEntry{Name: "gw-1" + peerSuffix, AddrV4: net.ParseIP("198.51.100.1"), Port: 7883, InfoFields: txt(testInfo())}
		<-ctx.Done() // a round listens until its time is up
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	peers, err := browseRounds(ctx, nil, true, true, slog.New(slog.DiscardHandler), func(string, ...any) {})
	if err != nil {
		t.Fatalf("browse: %v", err)
	}
	if len(peers) == 0 || peers[0].ID != testInfo().ID {
		t.Fatalf("peers %+v", peers)
	}
	if len(calls) < 2 || calls[0] || !calls[1] {
		t.Fatalf("queries (DisableIPv6): %v; want IPv6 tried once, then dropped", calls)
	}
	// Any other failure is still reported.
	mdnsQuery = func(context.Context, *mdns.QueryParam) error { return errors.New("no socket") }
	if _, err := browseRounds(context.Background(), nil, true, false, slog.New(slog.DiscardHandler), func(string, ...any) {}); err == nil {
		t.Fatal("a query that cannot listen: no error")
	}
}
