package discovery

import (
	"fmt"
	"net"
	"strings"

	"github.com/hashicorp/mdns"
	"github.com/miekg/dns"
)

// ttl of the records the hashicorp/mdns path serves, in seconds. That path
// cannot announce a change, so caches must not keep a record long: a
// resolver (avahi's too) re-queries at 80 % of it. Role, term and address
// changes thus reach caching peers within about this long.
const ttl = 20

// zone answers mDNS questions from the gateway's live state: every answer
// is built from Info() and the interface addresses at that moment.
type zone struct {
	cfg   Config
	ifi   *net.Interface                // nil: the addresses of every multicast interface
	addrs func(*net.Interface) []net.IP // localIPs; tests replace it
}

func newMDNSServer(cfg Config, ifi *net.Interface) (*mdns.Server, error) {
	s, err := mdns.NewServer(&mdns.Config{Zone: &zone{cfg: cfg, ifi: ifi, addrs: localIPs}, Iface: ifi, Logger: stdLogger(cfg.Logger)})
	if err != nil {
		return nil, fmt.Errorf("discovery: mdns: %w", err)
	}
	return s, nil
}

// Records implements mdns.Zone.
func (z *zone) Records(q dns.Question) []dns.RR {
	info := z.cfg.Info()
	ips := z.addrs(z.ifi)
	if len(ips) == 0 {
		return nil // no address to give (and NewMDNSService would do a DNS lookup)
	}
	var out []dns.RR
	seen := map[string]bool{}
	for _, svc := range services(z.cfg, info, ips) {
		for _, rr := range svc.Records(q) {
			rr.Header().Ttl = ttl
			// Both services answer for the host name: say it once.
			if k := rr.String(); !seen[k] {
				seen[k] = true
				out = append(out, rr)
			}
		}
	}
	if len(out) > 0 {
		z.cfg.Logger.Debug("mdns: answering", "question", q.Name, "type", dns.TypeToString[q.Qtype], "records", len(out))
	}
	return out
}

// services are the DNS-SD services for info, with hashicorp/mdns building
// the records. The host name is made from the node id, not the OS host
// name: gateways flashed from one image often share that ("raspberrypi"),
// and two hosts answering for one name would mix their addresses.
func services(cfg Config, info Info, ips []net.IP) []*mdns.MDNSService {
	inst := dnsLabel(instanceName(cfg, info))
	host := "tandem-" + dnsLabel(info.ID) + ".local."
	var out []*mdns.MDNSService
	if info.PeerPort > 0 {
		if s, err := mdns.NewMDNSService(inst, ServicePeers, "local.", host, info.PeerPort, ips, txt(info)); err == nil {
			out = append(out, s)
		}
	}
	if info.MQTTPort > 0 {
		if s, err := mdns.NewMDNSService(inst, ServiceMQTT, "local.", host, info.MQTTPort, ips, []string{TXTID + "=" + info.ID}); err == nil {
			out = append(out, s)
		}
	}
	return out
}

// dnsLabel makes s usable as one DNS label as hashicorp/mdns writes names
// unescaped: no dots, at most 63 bytes.
func dnsLabel(s string) string {
	s = strings.NewReplacer(".", "-", "\\", "-").Replace(s)
	if s == "" {
		s = "tandem"
	}
	if len(s) > 63 {
		s = s[:63]
	}
	return s
}

// localIPs are the addresses to advertise: those of ifi, or of every up,
// multicast-capable, non-loopback interface. IPv6 link-local addresses are
// left out: without their zone they are useless to a peer.
func localIPs(ifi *net.Interface) []net.IP {
	var ifs []net.Interface
	if ifi != nil {
		if cur, err := net.InterfaceByIndex(ifi.Index); err == nil {
			ifs = []net.Interface{*cur}
		}
	} else {
		ifs, _ = net.Interfaces()
	}
	var ips []net.IP
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 || i.Flags&net.FlagMulticast == 0 {
			continue
		}
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			n, ok := a.(*net.IPNet)
			if !ok || n.IP.IsLinkLocalUnicast() || n.IP.IsLoopback() {
				continue
			}
			ips = append(ips, n.IP)
		}
	}
	return ips
}
