// Package discovery owns mDNS: it advertises this gateway as _tandem._tcp
// (to its siblings) and _mqtt._tcp (to devices), browses for the others, and
// runs the pairing handshake. It imports no other package of tandem.
//
// The names below are part of the contract (DESIGN.md): tests, docs and
// other tools rely on them. The advertising and browsing themselves come
// with the discovery issue; mDNS is off in the embedded default.
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
