package discovery

import (
	"errors"
	"fmt"
	"net"
	"sort"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Info is what this gateway says about itself in _tandem._tcp. The daemon
// hands a func returning it to Advertise, which reads it afresh for every
// answer (hashicorp/mdns path) or on Changed (avahi path).
type Info struct {
	ID       string // node id, 16 hex digits
	Name     string // node name
	Cluster  string // cluster id; empty for a gateway in no cluster yet
	Role     string // "master", "slave", "candidate"
	Version  string // tandem version
	Gen      uint64 // cluster generation (bumped by a forced promotion)
	Term     uint64 // raft term
	PeerPort int    // port of the peer listener (the SRV port of _tandem._tcp)
	MQTTPort int    // MQTT port for devices; 0 advertises no _mqtt._tcp
	PairOpen bool   // pairing is open (TXT pair=open)
}

// Peer is a tandem gateway found on the LAN. Its JSON is the contract's
// `tandem peers --json` element.
type Peer struct {
	ID       string   `json:"id"`
	Name     string   `json:"name"`
	Cluster  string   `json:"cluster"`
	Gen      uint64   `json:"gen"`
	Role     string   `json:"role"`
	Term     uint64   `json:"term"`
	Addrs    []string `json:"addrs"` // host:peerport, as found now, sorted
	MQTTPort int      `json:"mqtt_port"`
	Version  string   `json:"version"`
	PairOpen bool     `json:"-"`
}

// maxValue bounds a TXT value read from the LAN; names and ids are short.
const maxValue = 128

// txt is the TXT record of _tandem._tcp for info, one "key=value" a string.
func txt(info Info) []string {
	t := []string{
		TXTID + "=" + info.ID,
		TXTName + "=" + info.Name,
		TXTCluster + "=" + info.Cluster,
		TXTGen + "=" + strconv.FormatUint(info.Gen, 10),
		TXTRole + "=" + info.Role,
		TXTTerm + "=" + strconv.FormatUint(info.Term, 10),
		TXTMQTT + "=" + strconv.Itoa(info.MQTTPort),
		TXTVersion + "=" + info.Version,
	}
	if info.PairOpen {
		t = append(t, TXTPair+"=open")
	}
	return t
}

// errBadTXT is why a TXT record from the LAN was ignored.
var errBadTXT = errors.New("discovery: bad TXT record")

// parseTXT reads a _tandem._tcp TXT record from the LAN. Anything odd is
// refused rather than shown or acted on: no id, a number that is not one,
// a value too long or with control characters. Unknown keys are skipped
// (newer versions may add some); keys are case-insensitive (RFC 6763 6.4),
// the first occurrence wins (6.4 too).
func parseTXT(fields []string) (Peer, error) {
	var p Peer
	seen := map[string]bool{}
	for _, f := range fields {
		k, v, _ := strings.Cut(f, "=")
		k = strings.ToLower(k)
		if k == "" || seen[k] {
			continue
		}
		seen[k] = true
		if len(v) > maxValue || !printable(v) {
			return Peer{}, fmt.Errorf("%w: %s: unprintable or longer than %d bytes", errBadTXT, k, maxValue)
		}
		var err error
		switch k {
		case TXTID:
			p.ID = v
		case TXTName:
			p.Name = v
		case TXTCluster:
			p.Cluster = v
		case TXTRole:
			p.Role = v
		case TXTVersion:
			p.Version = v
		case TXTGen:
			p.Gen, err = strconv.ParseUint(v, 10, 64)
		case TXTTerm:
			p.Term, err = strconv.ParseUint(v, 10, 64)
		case TXTMQTT:
			var n uint64
			n, err = strconv.ParseUint(v, 10, 16)
			p.MQTTPort = int(n)
		case TXTPair:
			p.PairOpen = v == "open"
		}
		if err != nil {
			return Peer{}, fmt.Errorf("%w: %s=%q", errBadTXT, k, v)
		}
	}
	if p.ID == "" {
		return Peer{}, fmt.Errorf("%w: no %s", errBadTXT, TXTID)
	}
	return p, nil
}

func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// merge folds the sightings of one Browse into one Peer per id: the
// addresses are their union; the other fields come from the last sighting
// (two sightings of one node within a browse differ only if it changed in
// between).
func merge(seen []Peer) []Peer {
	byID := map[string]*Peer{}
	var order []string
	for _, s := range seen {
		p, ok := byID[s.ID]
		if !ok {
			cp := s
			cp.Addrs = nil
			p = &cp
			byID[s.ID] = p
			order = append(order, s.ID)
		} else {
			addrs := p.Addrs
			*p = s
			p.Addrs = addrs
		}
		for _, a := range s.Addrs {
			if !contains(p.Addrs, a) {
				p.Addrs = append(p.Addrs, a)
			}
		}
	}
	out := make([]Peer, 0, len(order))
	for _, id := range order {
		p := byID[id]
		sort.Strings(p.Addrs)
		if p.Addrs == nil {
			p.Addrs = []string{}
		}
		out = append(out, *p)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Name != out[j].Name {
			return out[i].Name < out[j].Name
		}
		return out[i].ID < out[j].ID
	})
	return out
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// hostPort joins an address found over mDNS with a port; a link-local IPv6
// address gets the zone of the interface it was seen on.
func hostPort(ip net.IP, zone string, port int) string {
	h := ip.String()
	if ip.To4() == nil && ip.IsLinkLocalUnicast() && zone != "" {
		h += "%" + zone
	}
	return net.JoinHostPort(h, strconv.Itoa(port))
}
