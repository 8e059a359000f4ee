package mqtt

import (
	"fmt"
	"net"
	"net/url"
	"path"
	"strings"
)

// refusedWSOrigin: a browser page whose origin the WebSocket listener does
// not admit (originPolicy); its label in tandem_mqtt_refused_total.
const refusedWSOrigin = "ws_origin"

// originPolicy decides which browser pages may open MQTT connections on
// the WebSocket listener. The Origin header is what a browser says about
// the page, and the danger it guards against is a page of some web site
// using its visitor's browser to reach a gateway that trusts whoever
// connects. So:
//   - a request without Origin is no browser page's: admitted;
//   - an entry of origins admits the pages it names;
//   - a page of the listener's own host (any port) or of the visitor's own
//     machine (loopback) is admitted; the listener's host counts only when
//     the request names it by address (or localhost): a name may be
//     rebound by its owner's DNS to the visitor's gateway, and then the
//     page of evil.example would be of "the listener's host" evil.example;
//   - on a listener that requires credentials, with no origins set, every
//     page is admitted (a dashboard on another port or host, a file://
//     page's "null"): a hostile page cannot log in, as with Mosquitto,
//     EMQX and HiveMQ, which check no origin;
//   - anything else is refused, with a 403 that says why.
type originPolicy struct {
	patterns []originPattern
}

// originPattern is one entry of WebSocketConfig.OriginPatterns.
type originPattern struct {
	host string // lower case, path.Match wildcards allowed; "null" for Origin: null
	port string // "" or "*" for any port
}

// newOriginPolicy parses the origins entries: "host", "host:port",
// "*.example.com", "[::1]:8000", "null", with or without a scheme.
func newOriginPolicy(entries []string) (*originPolicy, error) {
	p := &originPolicy{}
	for _, e := range entries {
		s := strings.ToLower(strings.TrimSpace(e))
		if i := strings.Index(s, "://"); i >= 0 {
			s = s[i+3:]
		}
		s = strings.TrimSuffix(s, "/")
		if s == "" {
			return nil, fmt.Errorf("mqtt: websocket origins: empty entry")
		}
		var pat originPattern
		if h, port, err := net.SplitHostPort(s); err == nil {
			pat = originPattern{host: h, port: port}
		} else {
			pat = originPattern{host: strings.Trim(s, "[]")}
		}
		if _, err := path.Match(pat.host, ""); err != nil || strings.ContainsAny(pat.host, "/@") {
			return nil, fmt.Errorf("mqtt: websocket origins: %q is not a host pattern", e)
		}
		p.patterns = append(p.patterns, pat)
	}
	return p, nil
}

// refusal returns "" when a page of origin may open a WebSocket on a
// request for reqHost (its Host header), or why it may not. credentials
// says the listener admits no anonymous client.
func (p *originPolicy) refusal(origin, reqHost string, credentials bool) string {
	if origin == "" {
		return ""
	}
	open := credentials && len(p.patterns) == 0
	if strings.EqualFold(origin, "null") {
		if open || p.match("null", "") {
			return ""
		}
		return `Origin "null" (a file:// page or a sandboxed frame) is not admitted: list "null" in mqtt.websocket.origins` + p.hint(credentials)
	}
	u, err := url.Parse(origin)
	if err != nil || u.Host == "" {
		return fmt.Sprintf("Origin %q is not a valid origin", origin)
	}
	host, port := strings.ToLower(u.Hostname()), u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[strings.ToLower(u.Scheme)]
	}
	if open || p.match(host, port) || isLoopbackHost(host) {
		return ""
	}
	if own := hostOf(reqHost); host == own && (net.ParseIP(own) != nil || own == "localhost") {
		return ""
	}
	return fmt.Sprintf("Origin %q is not admitted: pages of loopback, of mqtt.websocket.origins and of the address the listener is reached at (any port) may connect", origin) + p.hint(credentials)
}

// hint tells how to admit more pages.
func (p *originPolicy) hint(credentials bool) string {
	if credentials {
		return ""
	}
	return "; this listener admits anonymous clients, so other pages are refused"
}

func (p *originPolicy) match(host, port string) bool {
	for _, pat := range p.patterns {
		if pat.port != "" && pat.port != "*" && pat.port != port {
			continue
		}
		if ok, _ := path.Match(pat.host, host); ok {
			return true
		}
	}
	return false
}

// hostOf returns the host of a Host header, lower case, without port or
// brackets.
func hostOf(hostport string) string {
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		return strings.ToLower(h)
	}
	return strings.ToLower(strings.Trim(hostport, "[]"))
}

// isLoopbackHost reports whether a page's host is the visitor's own
// machine.
func isLoopbackHost(h string) bool {
	if h == "localhost" || strings.HasSuffix(h, ".localhost") {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}
