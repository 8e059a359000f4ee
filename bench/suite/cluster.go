package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tandem-edge/tandem/bench"
)

// clusterConfig makes s/# sync and everything else async.
const clusterConfig = `node:
  name: %s
  data_dir: %s
topics:
  - match: "s/#"
    ack: sync
`

// cluster workloads: the single-gateway W1 as the reference, then the same
// load on clusters of 2 and 3 processes on loopback, with the clients on the
// master, and last on a slave, which forwards each publish to the master.
//
// Their figures are each member's own costs per message, which hold on any
// host: three fsyncing members and the load generator share this machine's
// cores, so a msg/s ratio to C1 follows how much CPU a message costs them
// all together and how busy the machine is (it swung ±0.1 between runs).
type clusterWorkload struct {
	name    string
	members int
	o       bench.Options
	topic   string
	onSlave bool   // the clients connect to a slave (bs[1])
	p99     string // a latency goal instead of the cost goals
	// inRAM puts the members' data dirs on tmpfs (/dev/shm), where an
	// fsync costs nothing: the latency is the replication path's own. On
	// this machine the three members' fsyncs queue on one device, where in
	// the field each gateway has its own.
	inRAM bool
	// p99Info prints the p99 without a verdict: with one disk for the
	// three members it measures that disk as much as tandem (see C5m).
	p99Info bool
}

var clusterWorkloads = []clusterWorkload{
	{"C1 async, 1 gw (ref.)", 1, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "a/%c", false, "", false, false},
	{"C2 async, 3 gw", 3, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "a/%c", false, "", false, false},
	{"C3 sync, 2 gw", 2, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "s/%c", false, "", false, false},
	{"C4 sync, 3 gw", 3, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "s/%c", false, "", false, false},
	{"C5 sync, 3 gw, 1 conn win 1", 3, bench.Options{Clients: 1, Count: 5000, Window: 1, QoS: 1, Size: 100}, "s/%c", false, "p99: information, one disk for 3", false, true},
	{"C5m C5, logs on tmpfs", 3, bench.Options{Clients: 1, Count: 5000, Window: 1, QoS: 1, Size: 100}, "s/%c", false, "p99 ≤3 ms", true, false},
	{"C6 async, 3 gw, on a slave", 3, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "a/%c", true, "", false, false},
	{"C7 sync, 3 gw, on a slave", 3, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "s/%c", true, "", false, false},
}

// The cost goals, as multiples of C1's CPU µs per message: a slave that
// only stores and applies what the master sends gets batches of records
// and should pay the batch's fsync, checkpoint and apply amortised; the
// master, and a slave that forwards its clients' publishes, do a lone
// gateway's work; the whole cluster at most half again a lone gateway's.
const (
	goalSlave   = 0.25
	goalMaster  = 1.0
	goalSum     = 1.5
	goalC5P99Ms = 3.0
)

// counters are one member's cumulative counters.
type counters struct {
	cpu          float64 // user+system seconds, /proc/PID/stat
	syscr, syscw uint64  // read and write syscalls, /proc/PID/io
	fsyncs       uint64  // the log's fsyncs, from its status
}

func memberCounters(b *broker) counters {
	c := counters{cpu: procCPU(b.cmd.Process.Pid), fsyncs: tandemFsyncs(b)}
	c.syscr, c.syscw = procSyscalls(b.cmd.Process.Pid)
	return c
}

// perMsg is one member's costs per acked message in one run.
type perMsg struct {
	us, reads, writes, fsyncs float64
}

func costsPerMsg(a, b counters, msgs float64) perMsg {
	return perMsg{
		us:     (b.cpu - a.cpu) * 1e6 / msgs,
		reads:  float64(b.syscr-a.syscr) / msgs,
		writes: float64(b.syscw-a.syscw) / msgs,
		fsyncs: float64(b.fsyncs-a.fsyncs) / msgs,
	}
}

func (p perMsg) add(q perMsg) perMsg {
	return perMsg{p.us + q.us, p.reads + q.reads, p.writes + q.writes, p.fsyncs + q.fsyncs}
}

// runClusters runs the cluster workloads reps times each, on one cluster
// per size, and prints for each its msg/s, ack latency and the replication
// lag seen, then each member's own CPU µs, read and write syscalls and
// fsyncs per message, the sum over the members, and each one's µs against
// C1's with its goal. The reps go round by round (C1, C2, ... then C1, C2,
// ... again) and each ratio is the median of the ratios to the C1 of the
// same round: this machine's speed drifts over minutes, which running one
// workload's reps back to back would put into the ratios. The counters are
// each member process's own (/proc/PID/stat and io), so neither the load
// generator nor anything else running on the machine counts in them.
func runClusters(bin, dir string, reps int, only string) {
	fmt.Printf("\nclusters on loopback (every member fsyncs before it reports; clients on the master unless said), %d rounds, medians\n", reps)
	fmt.Printf("each member's own CPU µs, read and write syscalls and fsyncs per acked message; × C1 is its µs/msg over C1's in the same round;\n")
	fmt.Printf("goals: a slave ≤%.2f×, the master and a forwarding slave ≤%.1f×, all members ≤%.1f× (C5m: p99 ≤%.0f ms; C5's p99 is for information)\n", goalSlave, goalMaster, goalSum, goalC5P99Ms)
	fmt.Printf("%-30s %10s %9s %9s %11s %11s\n", "", "msg/s", "p50 ms", "p99 ms", "max lag rec", "max lag s")
	fmt.Printf("%-30s %10s %9s %9s %11s %11s  %s\n", "  member", "µs/msg", "read/msg", "write/msg", "fsync/msg", "× C1", "(goal)")
	clusters := map[string][]*broker{}
	ramDir := ""
	defer func() {
		for _, bs := range clusters {
			for _, b := range bs {
				stop(b)
			}
		}
		if ramDir != "" {
			os.RemoveAll(ramDir)
		}
	}()
	var ws []clusterWorkload
	for _, w := range clusterWorkloads {
		first, _, _ := strings.Cut(w.name, " ")
		if only != "" && first != "C1" && !slices.Contains(strings.Split(only, ","), first) {
			continue
		}
		if w.inRAM && ramDir == "" {
			d, err := tmpfsDir()
			if err != nil {
				fmt.Printf("%-30s skipped: %v\n", w.name, err)
				continue
			}
			ramDir = d
		}
		ws = append(ws, w)
	}
	type result struct {
		ss      []sample
		members [][]perMsg  // per member, per round
		ratios  [][]float64 // per member, then the sum: per round, µs/msg over C1's
		roles   []string    // per member, as it said after the last round
		lagRec  uint64
		lagSec  float64
	}
	results := make([]result, len(ws))
	for r := 0; r < reps; r++ {
		var ref float64 // C1's µs/msg in this round
		for i, w := range ws {
			key, base := fmt.Sprintf("c%d", w.members), dir
			if w.inRAM {
				key, base = key+"-ram", ramDir
			}
			bs := clusters[key]
			if bs == nil {
				bs = startCluster(bin, filepath.Join(base, key), w.members)
				clusters[key] = bs
			}
			o := w.o
			o.Broker = bs[0].addr
			if w.onSlave {
				o.Broker = bs[1].addr
			}
			o.Topic = w.topic
			o.Version = 5
			res := &results[i]
			stopLag := watchLag(bs[0].http, &res.lagRec, &res.lagSec)
			before := make([]counters, len(bs))
			for j, b := range bs {
				before[j] = memberCounters(b)
			}
			out, err := bench.Run(context.Background(), o)
			after := make([]counters, len(bs))
			for j, b := range bs {
				after[j] = memberCounters(b)
			}
			stopLag()
			check(err)
			if out.Failed > 0 {
				fmt.Fprintf(os.Stderr, "%s: %d failed: %s\n", w.name, out.Failed, out.FirstFailure)
			}
			acked := float64(max(out.Acked, 1))
			if res.members == nil {
				res.members = make([][]perMsg, len(bs))
				res.ratios = make([][]float64, len(bs)+1)
				res.roles = make([]string, len(bs))
			}
			var sum perMsg
			for j, b := range bs {
				c := costsPerMsg(before[j], after[j], acked)
				sum = sum.add(c)
				res.members[j] = append(res.members[j], c)
				res.ratios[j] = append(res.ratios[j], c.us)
				res.roles[j] = memberRole(b, len(bs))
			}
			res.ratios[len(bs)] = append(res.ratios[len(bs)], sum.us)
			if i == 0 {
				ref = sum.us
			}
			for j := range res.ratios {
				res.ratios[j][r] /= ref
			}
			res.ss = append(res.ss, sample{res: out, cpuUsPerMsg: sum.us, fsyncsPerMsg: sum.fsyncs})
		}
	}
	for i, w := range ws {
		res := &results[i]
		m := median(res.ss)
		latency := ""
		switch {
		case w.p99Info:
			latency = fmt.Sprintf("  (%s)", w.p99)
		case w.p99 != "":
			latency = fmt.Sprintf("  (%s%s)", w.p99, verdict(m.res.AckP99Ms <= goalC5P99Ms))
		}
		fmt.Printf("%-30s %10.0f %9.3f %9.3f %11d %11.3f%s\n", w.name, m.res.MsgPerSec, m.res.AckP50Ms, m.res.AckP99Ms, res.lagRec, res.lagSec, latency)
		var sum perMsg
		for j, ps := range res.members {
			c := medianCosts(ps)
			sum = sum.add(c)
			role, limit := res.roles[j], 0.0
			forwarding := w.onSlave && j == 1
			switch {
			case i == 0, w.p99 != "":
				// C1 is the reference; C5 (one connection, window 1)
				// batches nothing, and the cost goals are about load.
			case role == "slave" && !forwarding:
				limit = goalSlave
			default:
				limit = goalMaster
			}
			if forwarding {
				role += ", forwarding"
			}
			printCosts(fmt.Sprintf("  gw-%d %s", j+1, role), c, medianOf(res.ratios[j]), limit)
		}
		if len(res.members) > 1 {
			limit := goalSum
			if w.p99 != "" {
				limit = 0
			}
			printCosts("  all members", sum, medianOf(res.ratios[len(res.members)]), limit)
		}
	}
}

// tmpfsDir makes a directory on /dev/shm for C5m's members, or says why
// it cannot.
func tmpfsDir() (string, error) {
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil {
		return "", fmt.Errorf("no /dev/shm: %w", err)
	}
	if st.Type != unix.TMPFS_MAGIC {
		return "", fmt.Errorf("/dev/shm is not a tmpfs")
	}
	return os.MkdirTemp("/dev/shm", "tandem-bench-")
}

// printCosts prints one member's (or the sum's) row; limit is its goal as
// a multiple of C1's µs/msg, 0 for none.
func printCosts(label string, c perMsg, ratio, limit float64) {
	goal := ""
	if limit > 0 {
		goal = fmt.Sprintf("  (≤%.2f×%s)", limit, verdict(ratio <= limit))
	}
	fmt.Printf("%-30s %10.1f %9.2f %9.2f %11.3f %10.2f×%s\n", label, c.us, c.reads, c.writes, c.fsyncs, ratio, goal)
}

func verdict(ok bool) string {
	if ok {
		return ": met"
	}
	return ": MISSED"
}

// medianCosts takes each figure's median over the rounds on its own.
func medianCosts(ps []perMsg) perMsg {
	pick := func(f func(perMsg) float64) float64 {
		xs := make([]float64, len(ps))
		for i, p := range ps {
			xs[i] = f(p)
		}
		return medianOf(xs)
	}
	return perMsg{
		us:     pick(func(p perMsg) float64 { return p.us }),
		reads:  pick(func(p perMsg) float64 { return p.reads }),
		writes: pick(func(p perMsg) float64 { return p.writes }),
		fsyncs: pick(func(p perMsg) float64 { return p.fsyncs }),
	}
}

func medianOf(xs []float64) float64 {
	ys := slices.Clone(xs)
	slices.Sort(ys)
	return ys[len(ys)/2]
}

// memberRole is the member's role as its status says ("master", "slave",
// "candidate"); a lone gateway's is "lone".
func memberRole(b *broker, n int) string {
	if n == 1 {
		return "lone"
	}
	resp, err := http.Get("http://" + b.http + "/v1/status")
	if err != nil {
		return "unreachable"
	}
	defer resp.Body.Close()
	var s struct {
		Role string `json:"role"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&s)
	return s.Role
}

// procSyscalls returns a process's read and write syscall counts from
// /proc/PID/io (syscr counts read, readv, recvmsg and the like, syscw
// write, writev, sendmsg; fsyncs are counted by the log).
func procSyscalls(pid int) (reads, writes uint64) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return 0, 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(l, ":")
		n, _ := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		switch k {
		case "syscr":
			reads = n
		case "syscw":
			writes = n
		}
	}
	return reads, writes
}

// watchLag polls the master's status until the returned stop is called,
// keeping the largest lag any member showed.
func watchLag(httpAddr string, rec *uint64, sec *float64) func() {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			resp, err := http.Get("http://" + httpAddr + "/v1/status")
			if err != nil {
				continue
			}
			var s struct {
				Members []struct {
					LagRecords uint64  `json:"lag_records"`
					LagSeconds float64 `json:"lag_seconds"`
				} `json:"members"`
			}
			_ = json.NewDecoder(resp.Body).Decode(&s)
			resp.Body.Close()
			for _, m := range s.Members {
				*rec = max(*rec, m.LagRecords)
				*sec = max(*sec, m.LagSeconds)
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}

// startCluster starts n gateways in dir; the first is the master, the
// others join it with `tandem cluster invite` and `join`.
func startCluster(bin, dir string, n int) []*broker {
	var bs []*broker
	for i := 0; i < n; i++ {
		gd := filepath.Join(dir, fmt.Sprintf("gw-%d", i+1))
		check(os.MkdirAll(gd, 0o755))
		cfg := filepath.Join(gd, "tandem.yaml")
		check(os.WriteFile(cfg, []byte(fmt.Sprintf(clusterConfig, fmt.Sprintf("gw-%d", i+1), filepath.Join(gd, "data"))), 0o644))
		mq, hp, pp := freePort(), freePort(), freePort()
		cmd := exec.Command(bin, "run", "--config", cfg, "--mqtt", mq, "--http", hp, "--peer", pp)
		logf, err := os.Create(filepath.Join(gd, "tandem.log"))
		check(err)
		cmd.Stdout, cmd.Stderr = logf, logf
		check(cmd.Start())
		b := &broker{name: fmt.Sprintf("gw-%d", i+1), addr: mq, cmd: cmd, http: hp, data: filepath.Join(gd, "data")}
		waitListening(mq)
		bs = append(bs, b)
	}
	for _, b := range bs[1:] {
		// The API token is in each gateway's data dir; the peers are on
		// loopback, which invite refuses without --loopback.
		out, err := exec.Command(bin, "cluster", "invite", "--loopback", "--http", bs[0].http, "--data", bs[0].data).Output()
		check(err)
		tok, _, _ := strings.Cut(string(out), "\n")
		if out, err := exec.Command(bin, "cluster", "join", tok, "--http", b.http, "--data", b.data).CombinedOutput(); err != nil {
			check(fmt.Errorf("join %s: %v: %s", b.name, err, out))
		}
	}
	// Wait for the shape: with 3, all voters; every member caught up.
	deadline := time.Now().Add(30 * time.Second)
	for n > 1 {
		resp, err := http.Get("http://" + bs[0].http + "/v1/status")
		if err == nil {
			var s struct {
				Members []struct {
					Voter      bool   `json:"voter"`
					Reachable  bool   `json:"reachable"`
					MatchIndex uint64 `json:"match_index"`
				} `json:"members"`
			}
			_ = json.NewDecoder(resp.Body).Decode(&s)
			resp.Body.Close()
			ok := len(s.Members) == n-1
			for _, m := range s.Members {
				ok = ok && m.Reachable && m.MatchIndex > 0 && m.Voter == (n == 3)
			}
			if ok {
				break
			}
		}
		if time.Now().After(deadline) {
			check(fmt.Errorf("a cluster of %d did not form", n))
		}
		time.Sleep(50 * time.Millisecond)
	}
	return bs
}
