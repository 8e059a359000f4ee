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
type clusterWorkload struct {
	name    string
	members int
	o       bench.Options
	topic   string
	goal    string
	onSlave bool // the clients connect to a slave
}

var clusterWorkloads = []clusterWorkload{
	{"C1 async, 1 gw (ref.)", 1, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "a/%c", "reference", false},
	{"C2 async, 3 gw", 3, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "a/%c", "≥0.7× C1", false},
	{"C3 sync, 2 gw", 2, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "s/%c", "≥0.5× C1", false},
	{"C4 sync, 3 gw", 3, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "s/%c", "≥0.7× C1", false},
	{"C5 sync, 3 gw, 1 conn win 1", 3, bench.Options{Clients: 1, Count: 5000, Window: 1, QoS: 1, Size: 100}, "s/%c", "p99 ≤3 ms", false},
	{"C6 async, 3 gw, on a slave", 3, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "a/%c", "≥0.7× C1", true},
	{"C7 sync, 3 gw, on a slave", 3, bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "s/%c", "≥0.7× C1", true},
}

// runClusters runs the cluster workloads reps times each, on one cluster
// per size, and prints medians and the replication lag seen. The reps go
// round by round (C1, C2, ... then C1, C2, ... again) and each workload's
// ratio is the median of its ratios to the C1 of the same round: this
// machine's speed drifts by a fifth over minutes, which running one
// workload's reps back to back put into the ratios.
//
// Beside each ratio: the cores the machine was busy during the run (the
// members, the load generator, which shares the machine, and the kernel's
// threads working for them: the journal, block I/O, softirqs; /proc/stat,
// so anything else running counts too), and the CPU/msg ratio, C1's busy
// CPU per message over the workload's. The msg/s ratio is the CPU/msg
// ratio times the workload's busy cores over C1's: where the cores run
// out, a ratio can pass its CPU/msg ratio only by as much as C1 left idle,
// and no change but less CPU per message lifts it.
func runClusters(bin, dir string, reps int, only string) {
	fmt.Printf("\nclusters on loopback (every member fsyncs before it reports; clients on the master unless said), %d rounds, medians; the ratio is the median of each round's against that round's C1\n", reps)
	fmt.Printf("%-30s %10s %9s %9s %11s %11s %9s %10s  %s\n", "", "msg/s", "p50 ms", "p99 ms", "max lag rec", "max lag s", "µs/msg", "fsync/msg", "ratio (goal)")
	clusters := map[int][]*broker{}
	defer func() {
		for _, bs := range clusters {
			for _, b := range bs {
				stop(b)
			}
		}
	}()
	var ws []clusterWorkload
	for _, w := range clusterWorkloads {
		if first, _, _ := strings.Cut(w.name, " "); only == "" || first == "C1" || slices.Contains(strings.Split(only, ","), first) {
			ws = append(ws, w)
		}
	}
	type result struct {
		ss     []sample
		ratios []float64
		costs  []float64 // per round: C1's CPU per message over this one's
		busy   []float64 // per round: the machine's cores busy
		lagRec uint64
		lagSec float64
	}
	results := make([]result, len(ws))
	for r := 0; r < reps; r++ {
		var ref, refCost float64
		for i, w := range ws {
			bs := clusters[w.members]
			if bs == nil {
				bs = startCluster(bin, filepath.Join(dir, fmt.Sprintf("c%d", w.members)), w.members)
				clusters[w.members] = bs
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
			cpu0, busy0, fsyncs0 := membersCPU(bs), machineBusy(), tandemFsyncs(bs[0])
			out, err := bench.Run(context.Background(), o)
			cpu, busy, fsyncs := membersCPU(bs)-cpu0, machineBusy()-busy0, tandemFsyncs(bs[0])-fsyncs0
			stopLag()
			check(err)
			if out.Failed > 0 {
				fmt.Fprintf(os.Stderr, "%s: %d failed: %s\n", w.name, out.Failed, out.FirstFailure)
			}
			acked := float64(max(out.Acked, 1))
			res.ss = append(res.ss, sample{res: out, cpuUsPerMsg: cpu * 1e6 / acked, fsyncsPerMsg: float64(fsyncs) / acked})
			cost := busy / acked // the machine's CPU seconds per message
			if i == 0 {
				ref, refCost = out.MsgPerSec, cost
			}
			res.ratios = append(res.ratios, out.MsgPerSec/ref)
			res.costs = append(res.costs, refCost/cost)
			res.busy = append(res.busy, busy/max(out.Seconds, 1e-9))
		}
	}
	for i, w := range ws {
		res := &results[i]
		m := median(res.ss)
		for _, xs := range [][]float64{res.ratios, res.costs, res.busy} {
			slices.Sort(xs)
		}
		mid := len(res.ratios) / 2
		ratio, cost, busy := res.ratios[mid], res.costs[mid], res.busy[mid]
		goal := w.goal + fmt.Sprintf("; %.1f cores busy", busy)
		if i > 0 {
			goal += fmt.Sprintf("; CPU/msg ratio %.2f×", cost)
		}
		fmt.Printf("%-30s %10.0f %9.3f %9.3f %11d %11.3f %9.1f %10.3f  %.2f× C1 (%s)\n", w.name, m.res.MsgPerSec, m.res.AckP50Ms, m.res.AckP99Ms, res.lagRec, res.lagSec, m.cpuUsPerMsg, m.fsyncsPerMsg, ratio, goal)
	}
}

// machineBusy is the CPU seconds the machine's cores have spent on
// anything but idling, waiting for I/O and a hypervisor's other guests
// (steal), from /proc/stat.
func machineBusy() float64 {
	b, err := os.ReadFile("/proc/stat")
	check(err)
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal …
	total := 0.0
	for _, i := range []int{1, 2, 3, 6, 7} {
		if i < len(f) {
			v, _ := strconv.ParseFloat(f[i], 64)
			total += v
		}
	}
	return total / 100 // USER_HZ
}

// membersCPU sums the members' user+system CPU seconds: what a message
// costs the whole cluster, which a busy machine's noise hides less than
// msg/s. (fsync/msg is the master's: bs[0].)
func membersCPU(bs []*broker) float64 {
	total := 0.0
	for _, b := range bs {
		total += procCPU(b.cmd.Process.Pid)
	}
	return total
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
