package discovery

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/hashicorp/mdns"
)

// DefaultBrowseTimeout is how long Browse listens when no timeout is given.
const DefaultBrowseTimeout = 2 * time.Second

// BrowseOptions tune Browse.
type BrowseOptions struct {
	// Interface to browse on (e.g. "eth0"); empty: the OS's choice (or
	// avahi's: every interface).
	Interface string
	// Timeout is how long to listen; zero means DefaultBrowseTimeout.
	Timeout time.Duration
	// Logger gets debug lines (peers ignored and why); nil discards them.
	Logger *slog.Logger
}

// queryRound is how long one hashicorp/mdns query listens. Its client asks
// once per query, so several short rounds within the timeout ask again for
// whoever missed the first question (a lost packet, a node just starting).
const queryRound = 700 * time.Millisecond

// Browse lists the tandem gateways that answer on the LAN within the
// timeout (or until ctx ends), one Peer per node id, sorted by name then
// id, each with the addresses found now. It goes through avahi-daemon where
// one runs (never opening port 5353 beside it), else hashicorp/mdns.
// Records with a bad TXT are ignored. It returns an error only when it
// could not listen at all.
func Browse(ctx context.Context, opts BrowseOptions) ([]Peer, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultBrowseTimeout
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	var ifi *net.Interface
	if opts.Interface != "" {
		var err error
		if ifi, err = net.InterfaceByName(opts.Interface); err != nil {
			return nil, fmt.Errorf("discovery: interface %q: %w", opts.Interface, err)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, opts.Timeout)
	defer cancel()
	logf := func(msg string, args ...any) { opts.Logger.Debug("mdns: "+msg, args...) }
	if conn := avahiConn(ctx); conn != nil {
		defer conn.Close()
		logf("browsing through avahi-daemon")
		return merge(browseAvahi(ctx, conn, ifi, logf)), nil
	}
	seen, err := browseMDNS(ctx, ifi, opts.Logger, logf)
	return merge(seen), err
}

// mdnsQuery is hashicorp/mdns's query, a variable so that tests can fake
// what a LAN refuses.
var mdnsQuery = mdns.QueryContext

// browseMDNS queries with hashicorp/mdns in rounds until ctx ends, over
// the address families the interfaces have.
func browseMDNS(ctx context.Context, ifi *net.Interface, log *slog.Logger, logf func(string, ...any)) ([]Peer, error) {
	v4, v6 := families(ifi)
	return browseRounds(ctx, ifi, v4, v6, log, logf)
}

// families reports whether ifi (every multicast interface that is up, when
// nil) has IPv4 and IPv6 addresses. The mdns client sends each query over
// both families and fails the whole query when one send fails: on a LAN
// without IPv6 (network namespaces, many plant networks) the kernel still
// opens a udp6 socket but refuses the send to ff02::fb ("cannot assign
// requested address"), so the family that is not there must not be
// asked. With no address at all, both are left to the client.
func families(ifi *net.Interface) (v4, v6 bool) {
	var ifs []net.Interface
	if ifi != nil {
		ifs = []net.Interface{*ifi}
	} else {
		all, err := net.Interfaces()
		if err != nil {
			return true, true
		}
		for _, i := range all {
			if i.Flags&net.FlagUp != 0 && i.Flags&net.FlagMulticast != 0 && i.Flags&net.FlagLoopback == 0 {
				ifs = append(ifs, i)
			}
		}
	}
	for _, i := range ifs {
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok {
				if ipn.IP.To4() != nil {
					v4 = true
				} else {
					v6 = true
				}
			}
		}
	}
	if !v4 && !v6 {
		return true, true
	}
	return v4, v6
}

// sendFamily names the family ("udp4", "udp6") of a query that failed
// to go out, or "" for any other error.
func sendFamily(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && (op.Net == "udp4" || op.Net == "udp6") {
		return op.Net
	}
	return ""
}

// browseRounds is browseMDNS over the families given. A family whose send
// fails is dropped and the round asked again over the other: a query is
// never failed for a family the LAN does not have.
func browseRounds(ctx context.Context, ifi *net.Interface, v4, v6 bool, log *slog.Logger, logf func(string, ...any)) ([]Peer, error) {
	var seen []Peer
	for ctx.Err() == nil {
		round := queryRound
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < round {
			round = time.Until(dl)
		}
		if round < 10*time.Millisecond {
			break
		}
		// Sends never block in the client: a buffer holds every answer.
		entries := make(chan *mdns.ServiceEntry, 256)
		err := mdnsQuery(ctx, &mdns.QueryParam{
			Service: ServicePeers, Domain: "local", Timeout: round, Interface: ifi,
			Entries: entries, Logger: stdLogger(log), DisableIPv4: !v4, DisableIPv6: !v6,
		})
		close(entries)
		for e := range entries {
			if p, ok := fromEntry(e, logf); ok {
				seen = append(seen, p)
			}
		}
		if fam := sendFamily(err); fam != "" && v4 && v6 {
			logf("cannot send over "+fam+" here: asking over the other family only", "err", err)
			if fam == "udp6" {
				v6 = false
			} else {
				v4 = false
			}
			continue
		}
		if err != nil && len(seen) == 0 && ctx.Err() == nil {
			return nil, fmt.Errorf("discovery: mdns query: %w", err)
		}
	}
	return seen, nil
}

// peerSuffix ends the instance name of every _tandem._tcp service; the
// client also hands over answers for other services asked nearby.
const peerSuffix = "." + ServicePeers + ".local."

// fromEntry turns a hashicorp/mdns answer into a Peer, or refuses it.
func fromEntry(e *mdns.ServiceEntry, logf func(string, ...any)) (Peer, bool) {
	if !strings.HasSuffix(strings.ToLower(e.Name), peerSuffix) {
		return Peer{}, false
	}
	p, err := parseTXT(e.InfoFields)
	if err != nil {
		logf("ignoring a peer", "name", e.Name, "err", err)
		return Peer{}, false
	}
	if e.Port <= 0 {
		return Peer{}, false
	}
	if e.AddrV4 != nil {
		p.Addrs = append(p.Addrs, hostPort(e.AddrV4, "", e.Port))
	}
	if e.AddrV6IPAddr != nil {
		p.Addrs = append(p.Addrs, hostPort(e.AddrV6IPAddr.IP, e.AddrV6IPAddr.Zone, e.Port))
	}
	return p, true
}
