package admin

import (
	"bytes"
	"context"
	_ "embed"
	"fmt"
	"html/template"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/version"
)

//go:embed page.html
var pageHTML string

// pageRefresh is how often the page reloads itself, in seconds: the
// sampler's pace, so each reload can show a new point.
const pageRefresh = 5

var pageTmpl = template.Must(template.New("page").Parse(pageHTML))

// pageData is what page.html renders; everything is formatted here so the
// template stays markup.
type pageData struct {
	Name, Role, Term, Leader, Version, Updated string
	Cluster                                    string
	Refresh                                    int
	Err                                        string
	Nodes                                      []nodeRow
	Topics                                     []topicRow
	TopicsCounted                              bool
	Disk                                       diskView
	Clients, Inflight, Retained                string
	Log                                        [4]string // first, last, commit, applied
	Pairing                                    string
	FeatureLevel                               string // the cluster's
	PairingOpen                                bool
	InRate, AckRate                            string
	Throughput, Lag                            sparkline
	Uplinks                                    []uplinkRow // uplinkpage.go
	Backlog                                    sparkline
}

type nodeRow struct {
	Name, ID, Role, Term, Addr, Health, Lag string
	Version                                 string // release and the feature level its build knows
	Self, OK, Learner                       bool
}

type topicRow struct{ Filter, Ack, Rate string }

type diskView struct {
	Used, Free, Budget string
	Percent            int    // of the budget, or of used+free without one
	Oldest             string // age of the oldest record kept, "" when none
	Refusing           bool   // publishes refused (disk nearly full, budget full of what a member lacks): shown in red
	RefusingWhy        string // why, as status says
}

// sparkline is an inline SVG polyline, scaled to its own maximum.
type sparkline struct {
	Points     string
	Max, Last  string
	Width      int
	Height     int
	Collecting bool
}

func (fv *FieldView) servePage(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	data := fv.pageData(ctx)
	var buf bytes.Buffer
	if err := pageTmpl.Execute(&buf, data); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(buf.Bytes())
}

func (fv *FieldView) pageData(ctx context.Context) *pageData {
	p := &pageData{Name: fv.cfg.Node.Name, Version: version.Version, Refresh: pageRefresh, Updated: time.Now().Format("15:04:05")}
	live := fv.gw.Live()
	p.Topics, p.TopicsCounted = topicRows(live, fv.hist.rates(live))
	samples := fv.hist.samples()
	p.Throughput = newSparkline(samples, func(s sample) float64 { return s.In }, "/s")
	p.Lag = newSparkline(samples, func(s sample) float64 { return float64(s.LagRecords) }, "")
	if n := len(samples); n > 0 {
		p.InRate = rate(samples[n-1].In)
		p.AckRate = rate(samples[n-1].Acks)
	} else {
		p.InRate, p.AckRate = "…", "…"
	}
	s, err := fv.gw.Status(ctx)
	if err != nil {
		p.Err = err.Error()
		p.Role = "unknown"
		return p
	}
	p.Name, p.Role, p.Term = s.Node.Name, s.Role, strconv.FormatUint(s.Term, 10)
	p.Cluster = ShortID(s.Cluster.ID)
	p.Leader = "none"
	if s.Leader != nil {
		p.Leader = NameOr(s.Leader.Name, s.Leader.ID)
	}
	self := nodeRow{Name: s.Node.Name, ID: ShortID(s.Node.ID), Role: s.Role, Term: p.Term, Addr: fv.peerAddr(s), Self: true, OK: true, Health: "serving", Lag: "—",
		Version: fmt.Sprintf("%s (level %d)", s.Node.Version, s.Cluster.FeatureLevelKnown)}
	p.FeatureLevel = strconv.Itoa(s.Cluster.FeatureLevel)
	if s.NotServing != nil {
		// The status's own finding, which /healthz reads too.
		self.OK, self.Health = false, *s.NotServing
	}
	p.Nodes = append(p.Nodes, self)
	for _, m := range s.Members {
		row := nodeRow{Name: NameOr(m.Name, m.ID), ID: ShortID(m.ID), Role: m.Role, Term: "—", Addr: OrDash(m.Addr), OK: m.Reachable, Learner: !m.Voter, Version: "—"}
		if m.FeatureLevel > 0 {
			row.Version = fmt.Sprintf("%s (level %d)", OrDash(m.Version), m.FeatureLevel)
		}
		row.Health, row.Lag = "unreachable", "—"
		if m.Reachable {
			row.Health = "reachable"
		}
		if s.Role == "master" {
			// Only the master knows how far the others' logs are.
			row.Lag = fmt.Sprintf("%d / %.1f", m.LagRecords, m.LagSeconds)
		}
		if m.TopicsMatch != nil && !*m.TopicsMatch {
			row.Health += ", other topic rules"
			row.OK = false
		}
		p.Nodes = append(p.Nodes, row)
	}
	p.Disk = diskView{Used: FormatBytes(uint64(max(s.Disk.UsedBytes, 0))), Free: FormatBytes(s.Disk.FreeBytes), Budget: "none"}
	whole := uint64(max(s.Disk.UsedBytes, 0)) + s.Disk.FreeBytes
	if s.Disk.BudgetBytes > 0 {
		p.Disk.Budget = FormatBytes(s.Disk.BudgetBytes)
		whole = s.Disk.BudgetBytes
	}
	if s.Storage.OldestAgeSeconds > 0 {
		p.Disk.Oldest = (time.Duration(s.Storage.OldestAgeSeconds) * time.Second).String()
	}
	p.Disk.Refusing = s.Storage.IsRefusing()
	if s.Storage.Refusing != nil {
		p.Disk.RefusingWhy = *s.Storage.Refusing
	}
	if whole > 0 {
		p.Disk.Percent = int(min(100, uint64(max(s.Disk.UsedBytes, 0))*100/whole))
	}
	p.Clients = strconv.FormatInt(s.MQTT.Clients, 10)
	p.Inflight = strconv.FormatInt(s.MQTT.Inflight, 10)
	p.Retained = strconv.FormatInt(fv.gw.Retained(), 10)
	p.Log = [4]string{strconv.FormatUint(s.Log.FirstIndex, 10), strconv.FormatUint(s.Log.LastIndex, 10),
		strconv.FormatUint(s.Log.CommitIndex, 10), strconv.FormatUint(s.Log.AppliedIndex, 10)}
	p.Uplinks, p.Backlog = uplinkRows(s), newSparkline(samples, func(s sample) float64 { return float64(s.Backlog) }, "")
	p.Pairing, p.PairingOpen = "closed", s.Pairing.Open
	if s.Pairing.Open {
		p.Pairing = "open"
		if s.Pairing.Expires != nil {
			p.Pairing += " until " + s.Pairing.Expires.Local().Format("15:04:05")
		}
	}
	return p
}

// peerAddr is the address other gateways reach this one at.
func (fv *FieldView) peerAddr(s *Status) string {
	if len(s.Cluster.PeerAddrs) > 0 {
		return strings.Join(s.Cluster.PeerAddrs, ", ")
	}
	return fv.cfg.Peer.Listen
}

// topicRows lists the topic rules in force with their rates, then the
// default for topics no rule matches. counted is false when the rates are
// not known for these rules yet (just started, or just reloaded).
func topicRows(live *config.Config, rates []float64) (rows []topicRow, counted bool) {
	counted = rates != nil
	r := func(i int) string {
		if i+1 < len(rates) {
			return rate(rates[i+1])
		}
		return "—"
	}
	catchAll := false
	if live != nil {
		for i, t := range live.Topics {
			ack := t.Ack
			if ack == "" {
				ack = "async"
			}
			rows = append(rows, topicRow{Filter: t.Match, Ack: ack, Rate: r(i)})
			catchAll = catchAll || t.Match == "#"
		}
	}
	// The first match wins, so behind a "#" rule nothing is left for the
	// default: a row for it would read as traffic the rules miss.
	if !catchAll {
		rows = append(rows, topicRow{Filter: "everything else", Ack: "async", Rate: r(-1)})
	}
	return rows, counted
}

func newSparkline(samples []sample, v func(sample) float64, unit string) sparkline {
	sl := sparkline{Width: 2 * historySize, Height: 40}
	if len(samples) < 2 {
		sl.Collecting = true
		return sl
	}
	hi := 0.0
	for _, s := range samples {
		hi = max(hi, v(s))
	}
	var b strings.Builder
	// Right-aligned: the newest sample is at the right edge, so the x axis
	// is the same ten minutes whatever the history holds.
	x0 := sl.Width - 2*(len(samples)-1)
	for i, s := range samples {
		y := float64(sl.Height - 1)
		if hi > 0 {
			y -= v(s) / hi * float64(sl.Height-2)
		}
		fmt.Fprintf(&b, "%d,%.1f ", x0+2*i, y)
	}
	sl.Points = strings.TrimSpace(b.String())
	sl.Max = compact(hi) + unit
	sl.Last = compact(v(samples[len(samples)-1])) + unit
	return sl
}

func rate(v float64) string { return compact(v) + "/s" }

// compact formats a rate or count for a narrow screen: 0, 3.2, 41, 1.2k.
func compact(v float64) string {
	switch {
	case v >= 1e6:
		return strconv.FormatFloat(v/1e6, 'f', 1, 64) + "M"
	case v >= 1e4:
		return strconv.FormatFloat(v/1e3, 'f', 0, 64) + "k"
	case v >= 1e3:
		return strconv.FormatFloat(v/1e3, 'f', 1, 64) + "k"
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(math.Round(v*10)/10, 'f', -1, 64)
}

// FormatBytes formats a size with binary units, as the config takes them.
func FormatBytes(n uint64) string {
	const unit = 1024
	if n < unit {
		return strconv.FormatUint(n, 10) + " B"
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// ShortID is the human form of a node id (DESIGN.md: its first 8 digits).
func ShortID(id string) string {
	if len(id) > 8 {
		return id[:8]
	}
	return id
}

// NameOr is a member's name, or its short id when it has none.
func NameOr(name, id string) string {
	if name != "" {
		return name
	}
	return ShortID(id)
}

// OrDash is s, or "-" for an empty one: a table cell that is never blank.
func OrDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
