package admin

import (
	"fmt"
	"time"
)

// uplinkRow is one uplink on the status page.
type uplinkRow struct {
	Name, State, Backlog, Oldest, Rate, ETA, Err string
	OK                                           bool
}

// uplinkRows formats the uplinks of s for the page.
func uplinkRows(s *Status) []uplinkRow {
	var rows []uplinkRow
	for _, u := range s.Uplinks {
		r := uplinkRow{Name: u.Name, State: "disconnected", Rate: rate(u.Rate), ETA: "—", Err: OrDash(u.LastError), Oldest: "—"}
		switch {
		case !u.Running:
			r.State, r.OK = "idle (not master)", true
		case u.Paused:
			r.State = "paused"
		case u.Connected:
			r.State, r.OK = "connected", true
		}
		if u.Full {
			r.State, r.OK = r.State+", backlog full", false
		}
		r.Backlog = fmt.Sprintf("%d / %s", u.BacklogRecords, FormatBytes(uint64(u.BacklogBytes)))
		if u.OldestAgeSeconds > 0 {
			r.Oldest = (time.Duration(u.OldestAgeSeconds) * time.Second).String()
		}
		if u.ReplayETASeconds != nil {
			r.ETA = (time.Duration(*u.ReplayETASeconds) * time.Second).String()
		}
		rows = append(rows, r)
	}
	return rows
}

// uplinkBacklog is the records all uplinks of s have yet to forward: the
// page's backlog sparkline.
func uplinkBacklog(s *Status) int64 {
	var n int64
	for _, u := range s.Uplinks {
		n += u.BacklogRecords
	}
	return n
}
