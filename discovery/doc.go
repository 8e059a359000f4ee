// Package discovery owns mDNS: it advertises this gateway as _tandem._tcp
// (to its siblings) and _mqtt._tcp (to devices) and browses for the others.
// It imports no other package of tandem. Pairing builds on it elsewhere.
//
// Two paths, chosen when Advertise or Browse starts:
//   - avahi-daemon over D-Bus, where it runs (org.freedesktop.Avahi has an
//     owner on the system bus; DBUS_SYSTEM_BUS_ADDRESS is honoured). Sharing
//     port 5353 with avahi starves it, so on this path tandem never opens
//     5353 itself. Avahi announces changes and says goodbye on Close.
//   - github.com/hashicorp/mdns everywhere else. It only answers queries (no
//     announcements, no goodbye: peers age our records out), so the records
//     it serves are built from Config.Info at the moment of each query, and
//     carry a short TTL so that caches (avahi's among them) follow changes.
//
// Advertise's Advertiser is safe for concurrent use. Browse takes a snapshot:
// the peers that answered within the timeout, each with the addresses it
// has now.
//
// The names below are part of the contract (DESIGN.md): tests, docs and
// other tools rely on them. mDNS is off in the embedded default.
package discovery

// Service types advertised over mDNS.
const (
	ServicePeers = "_tandem._tcp"
	ServiceMQTT  = "_mqtt._tcp"
)

// TXT record keys of _tandem._tcp.
const (
	TXTID      = "id"
	TXTName    = "name"
	TXTCluster = "cluster"
	TXTGen     = "gen"
	TXTRole    = "role"
	TXTTerm    = "term"
	TXTMQTT    = "mqtt"
	TXTVersion = "ver"
	TXTPair    = "pair" // "open" while pairing is open
)
