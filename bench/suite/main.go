// Command suite is `make bench`: it starts a fresh `tandem run` and a
// Mosquitto 2 (in memory, never fsyncs) on loopback, runs the standard
// workloads against both in turn (A B A B A B) and prints one table with
// medians: msg/s, ack p50/p99, broker CPU µs per message, fsyncs per
// message, bytes written to the device per message, RSS, and the ratio.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/tandem-edge/tandem/bench"
)

type workload struct {
	name string
	o    bench.Options
	// report says which figure the goal is about.
	goal string
}

var workloads = []workload{
	{"W1", bench.Options{Clients: 50, Count: 2000, Window: 1, QoS: 1, Size: 100}, "≥0.8×, ≤25 µs/msg"},
	{"W2", bench.Options{Clients: 1, Count: 20000, Window: 64, QoS: 1, Size: 100}, "≥0.7×"},
	{"W3", bench.Options{Clients: 1, Count: 5000, Window: 1, QoS: 1, Size: 100}, "p99 ≤1.5 ms"},
	{"W4", bench.Options{Clients: 50, Count: 2000, Window: 16, QoS: 1, Size: 100}, "≥0.8×"},
}

// broker is one server under test.
type broker struct {
	name string
	addr string
	cmd  *exec.Cmd
	http string // tandem only: its status endpoint
}

type sample struct {
	res            *bench.Result
	cpuUsPerMsg    float64
	fsyncsPerMsg   float64
	devBytesPerMsg float64
	rssMB          float64
}

func main() {
	tandemBin := flag.String("tandem", "bin/tandem", "tandem binary")
	reps := flag.Int("reps", 3, "runs of each workload per broker (the median is shown)")
	only := flag.String("only", "", "comma-separated workloads to run (default all)")
	clusters := flag.Bool("clusters", true, "also run the cluster workloads (2 and 3 gateways on loopback)")
	flag.Parse()

	dir, err := os.MkdirTemp("", "tandem-bench-")
	check(err)
	defer os.RemoveAll(dir)
	dev := deviceStat(dir)

	tan := startTandem(*tandemBin, dir)
	defer stop(tan)
	mos := startMosquitto(dir)
	defer stop(mos)

	fmt.Printf("machine: %d CPUs, %s; device counters: %s\n", numCPU(), cpuModel(), dev)
	fmt.Printf("tandem %s vs mosquitto %s, %d runs each, A B A B …, medians\n\n", tan.addr, mos.addr, *reps)
	fmt.Printf("%-4s %-9s %10s %9s %9s %9s %10s %11s %8s  %s\n", "", "broker", "msg/s", "p50 ms", "p99 ms", "µs/msg", "fsync/msg", "dev B/msg", "RSS MB", "ratio (goal)")
	for _, w := range workloads {
		if *only != "" && !slices.Contains(strings.Split(*only, ","), w.name) {
			continue
		}
		var st, sm []sample
		for r := 0; r < *reps; r++ {
			st = append(st, run(tan, w, dev))
			sm = append(sm, run(mos, w, dev))
		}
		a, b := median(st), median(sm)
		printRow(w.name, "tandem", a)
		printRow("", "mosquitto", b)
		fmt.Printf("%-4s %-9s %10s  tandem/mosquitto = %.2f× msg/s (%s)\n\n", "", "", "", a.res.MsgPerSec/b.res.MsgPerSec, w.goal)
	}
	if *clusters {
		stop(tan)
		stop(mos)
		runClusters(*tandemBin, dir, *reps)
	}
}

func printRow(w, name string, s sample) {
	fmt.Printf("%-4s %-9s %10.0f %9.3f %9.3f %9.1f %10.3f %11.0f %8.1f\n", w, name, s.res.MsgPerSec, s.res.AckP50Ms, s.res.AckP99Ms, s.cpuUsPerMsg, s.fsyncsPerMsg, s.devBytesPerMsg, s.rssMB)
}

func median(ss []sample) sample {
	slices.SortFunc(ss, func(a, b sample) int {
		switch {
		case a.res.MsgPerSec < b.res.MsgPerSec:
			return -1
		case a.res.MsgPerSec > b.res.MsgPerSec:
			return 1
		}
		return 0
	})
	return ss[len(ss)/2]
}

func run(b *broker, w workload, dev string) sample {
	o := w.o
	o.Broker = b.addr
	o.Topic = "bench/" + w.name + "/%c"
	o.Version = 5
	cpu0 := procCPU(b.cmd.Process.Pid)
	fsyncs0 := tandemFsyncs(b)
	dev0 := deviceBytes(dev)
	res, err := bench.Run(context.Background(), o)
	check(err)
	if res.Failed > 0 {
		fmt.Fprintf(os.Stderr, "%s on %s: %d failed: %s\n", w.name, b.name, res.Failed, res.FirstFailure)
	}
	cpu := procCPU(b.cmd.Process.Pid) - cpu0
	s := sample{res: res}
	s.cpuUsPerMsg = cpu * 1e6 / float64(res.Acked)
	s.fsyncsPerMsg = float64(tandemFsyncs(b)-fsyncs0) / float64(res.Acked)
	s.devBytesPerMsg = float64(deviceBytes(dev)-dev0) / float64(res.Acked)
	s.rssMB = procRSS(b.cmd.Process.Pid)
	return s
}

func startTandem(bin, dir string) *broker {
	mq, hp := freePort(), freePort()
	cmd := exec.Command(bin, "run", "--data", filepath.Join(dir, "tandem-data"), "--mqtt", mq, "--http", hp, "--peer", "127.0.0.1:0")
	logf, err := os.Create(filepath.Join(dir, "tandem.log"))
	check(err)
	cmd.Stdout, cmd.Stderr = logf, logf
	check(cmd.Start())
	b := &broker{name: "tandem", addr: mq, cmd: cmd, http: hp}
	waitListening(mq)
	return b
}

func startMosquitto(dir string) *broker {
	port := freePort()
	_, p, _ := net.SplitHostPort(port)
	conf := filepath.Join(dir, "mosquitto.conf")
	check(os.WriteFile(conf, []byte(fmt.Sprintf("listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nmax_inflight_messages 0\nmax_queued_messages 100000\n", p)), 0o644))
	cmd := exec.Command("mosquitto", "-c", conf)
	logf, err := os.Create(filepath.Join(dir, "mosquitto.log"))
	check(err)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "mosquitto is needed for the comparison: apt-get install mosquitto")
		os.Exit(1)
	}
	waitListening(port)
	return &broker{name: "mosquitto", addr: port, cmd: cmd}
}

func stop(b *broker) {
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = b.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = b.cmd.Process.Kill()
		<-done
	}
}

func tandemFsyncs(b *broker) uint64 {
	if b.http == "" {
		return 0
	}
	resp, err := http.Get("http://" + b.http + "/v1/status")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var s struct {
		Storage struct {
			Fsyncs uint64 `json:"fsyncs"`
		} `json:"storage"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&s)
	return s.Storage.Fsyncs
}

func freePort() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	check(err)
	defer l.Close()
	return l.Addr().String()
}

func waitListening(addr string) {
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	check(fmt.Errorf("%s never started listening", addr))
}

// procCPU returns a process's user+system CPU seconds from /proc/PID/stat.
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	check(err)
	// Fields after the command name (which may contain spaces).
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100 // USER_HZ is 100 on Linux
}

func procRSS(pid int) float64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "VmRSS:") {
			kb, _ := strconv.ParseFloat(strings.Fields(sc.Text())[1], 64)
			return kb / 1024
		}
	}
	return 0
}

// deviceStat finds /sys/dev/block/MAJ:MIN/stat of the device holding dir:
// its sector counters are the honest bytes written (FACTS.md).
func deviceStat(dir string) string {
	var st syscall.Stat_t
	check(syscall.Stat(dir, &st))
	maj, min := (st.Dev>>8)&0xfff|(st.Dev>>32)&^0xfff, st.Dev&0xff|(st.Dev>>12)&^0xff
	return fmt.Sprintf("/sys/dev/block/%d:%d/stat", maj, min)
}

func deviceBytes(path string) uint64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 7 {
		return 0
	}
	sectors, _ := strconv.ParseUint(f[6], 10, 64)
	return sectors * 512
}

func numCPU() int {
	b, _ := os.ReadFile("/proc/cpuinfo")
	return strings.Count(string(b), "processor\t:")
}

func cpuModel() string {
	b, _ := os.ReadFile("/proc/cpuinfo")
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "model name") {
			return strings.TrimSpace(l[strings.IndexByte(l, ':')+1:])
		}
	}
	return "unknown CPU"
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}
