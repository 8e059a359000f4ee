package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/term"

	"github.com/tandem-edge/tandem/admin"
)

// catchUpPoll is how often `cluster join` reads the gateway's status while
// it catches up; catchUpLine is how often it prints a line when its output
// is not a terminal (a log, a pipe), where a bar redrawn in place is noise.
const (
	catchUpPoll = 500 * time.Millisecond
	catchUpLine = 5 * time.Second
)

// showCatchUp follows a gateway that just joined as it takes in the
// cluster's history: the log up to to (the master's commit index when it
// took the gateway in), replayed or installed as a snapshot, and then,
// after a snapshot (status log.catching_up), the records before it that
// the master still holds. It draws a progress bar (records and bytes,
// rate, ETA) until both are done and says how long it took. The gateway
// catches up whether or not anyone watches: stopping the command (Ctrl-C)
// stops only the display.
func showCatchUp(w io.Writer, f *apiFlags, to uint64) error {
	tty := false
	if file, ok := w.(*os.File); ok {
		tty = term.IsTerminal(int(file.Fd()))
	}
	start := time.Now()
	var last time.Time
	shown, pulled := false, false
	var got admin.StatusCatchUp
	var applied uint64
	for {
		_, body, err := f.getStatus()
		if err != nil {
			return err
		}
		var st admin.Status
		if err := json.Unmarshal(body, &st); err != nil {
			return fmt.Errorf("reading the gateway's status: %w", err)
		}
		var line string
		switch {
		case st.Log.CatchingUp && st.Log.CatchUp != nil:
			got, pulled = *st.Log.CatchUp, true
			line = catchUpText(got, time.Since(start))
		case st.Log.AppliedIndex < to:
			applied = st.Log.AppliedIndex
			line = historyText(applied, to)
		default:
			if shown {
				if tty {
					fmt.Fprintln(w)
				}
				if pulled {
					fmt.Fprintf(w, "caught up: %d records (%s) pulled from the master in %s\n", got.RecordsPulled, sizeText(got.BytesPulled), time.Since(start).Round(time.Second))
				} else {
					fmt.Fprintf(w, "caught up: the cluster's log is here up to index %d, in %s\n", to, time.Since(start).Round(time.Second))
				}
			}
			return nil
		}
		if now := time.Now(); tty || !shown || now.Sub(last) >= catchUpLine {
			if tty {
				fmt.Fprintf(w, "\r%s\x1b[K", line)
			} else {
				fmt.Fprintln(w, line)
			}
			shown, last = true, now
		}
		time.Sleep(catchUpPoll) // a display's refresh, not a synchronisation
	}
}

// historyText is the progress line while the gateway takes in the log up
// to the index the master had committed when it took it in.
func historyText(applied, to uint64) string {
	const width = 24
	frac := float64(applied) / float64(max(to, 1))
	done := int(frac * width)
	return fmt.Sprintf("taking in the cluster's log: [%s%s] %3.0f%% index %d of %d (replayed, or a snapshot of the broker state)",
		strings.Repeat("#", done), strings.Repeat(".", width-done), frac*100, applied, to)
}

// catchUpText is one line of the progress bar.
func catchUpText(c admin.StatusCatchUp, elapsed time.Duration) string {
	const width = 24
	secs := max(elapsed.Seconds(), 0.001)
	rate := fmt.Sprintf("%s/s", sizeText(uint64(float64(c.BytesPulled)/secs)))
	if c.RecordsLeft < 0 {
		return fmt.Sprintf("catching up: [%s] asking the master for the records before the snapshot", strings.Repeat(" ", width))
	}
	total := c.RecordsPulled + uint64(c.RecordsLeft)
	frac := 1.0
	if total > 0 {
		frac = float64(c.RecordsPulled) / float64(total)
	}
	done := int(frac * width)
	eta := "ETA --"
	if c.RecordsPulled > 0 {
		left := time.Duration(float64(c.RecordsLeft) / (float64(c.RecordsPulled) / secs) * float64(time.Second))
		eta = "ETA " + left.Round(time.Second).String()
	}
	return fmt.Sprintf("catching up: [%s%s] %3.0f%% %d/%d records, %s, %s, %s",
		strings.Repeat("#", done), strings.Repeat(".", width-done), frac*100, c.RecordsPulled, total, sizeText(c.BytesPulled), rate, eta)
}

// sizeText writes n bytes in KiB/MiB/GiB.
func sizeText(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
