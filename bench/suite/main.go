// Command suite is `make bench`: it starts a fresh `tandem run` and a
// Mosquitto 2 (in memory, never fsyncs) on loopback, runs the standard
// workloads against both in turn (A B A B A B) and prints one table with
// medians: msg/s, ack p50/p99, broker CPU µs per message, fsyncs per
// message, bytes written to the device per message, RSS, and the ratio,
// and under each broker's row the kernel work per message: read and write
// syscalls (/proc/PID/io syscr, syscw) and context switches, voluntary
// (the broker's threads sleeping to be woken again) and involuntary,
// summed over /proc/PID/task/*/status. Those counts, unlike µs/msg, hold
// on a busy host. Under tandem's row a second line takes dev B/msg apart:
// the bytes per message its storage layer wrote, by file (its
// tandem_storage_written_bytes_total), and what the device wrote beyond
// them.
//
// W5 is fan-out (1 publisher, 20 QoS 1 MQTT 5 subscribers with Receive
// Maximum 20): its row shows deliveries/s, end-to-end p50/p99 and broker
// CPU µs per delivery. W6 opens 5,000 idle connections to a newly
// started broker (tandem restarted on the data W1-W5 left) and shows its
// RSS with them open, beside its RSS before and the KiB each connection
// added. The storage workloads (storage.go) then compare tandem with
// itself, and the cluster workloads (cluster.go) run last. For W6 tandem
// runs with mqtt.max_clients 10000 and its per-address connect rate and
// connection limits lifted (every connection comes from 127.0.0.1); the suite raises its own
// RLIMIT_NOFILE, which both brokers inherit. A run that fails (or hangs past its time-out) restarts that
// broker before the next run, so one stuck broker does not stall the rest.
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
	{"W5", bench.Options{Clients: 1, Count: 5000, Window: 16, QoS: 1, Size: 100,
		Subscribers: 20, SubscribeQoS: 1, SubscriberReceiveMax: 20}, "≥0.8×"},
	{"W6", bench.Options{Idle: 5000}, "≤50 MB, ≤6 KiB/connection"},
}

// runTimeout bounds one run: a broker that stops acking or delivering
// fails that run instead of stalling the suite.
const runTimeout = time.Minute

// broker is one server under test.
type broker struct {
	name  string
	addr  string
	cmd   *exec.Cmd
	http  string         // tandem only: its status endpoint
	data  string         // tandem cluster members: the data dir (the API token)
	start func() *broker // starts it again (same data dir)
}

type sample struct {
	res            *bench.Result
	cpuUsPerMsg    float64 // per delivery for a fan-out workload
	fsyncsPerMsg   float64
	devBytesPerMsg float64
	rssMB          float64
	rssBeforeMB    float64    // idle workload: RSS before the connections
	kernel         kernelWork // per message (per delivery for a fan-out workload)
	failed         bool
	// written is what tandem's storage layer wrote per message, by file
	// (its /metrics); hasWritten is false for Mosquitto.
	written    bench.StorageWritten
	hasWritten bool
}

// tandemConfig is the gateway's config for the suite: enough clients for
// W6, and no per-address connect rate or connection limit (every client
// is 127.0.0.1).
const tandemConfig = `node:
  data_dir: %s
mqtt:
  max_clients: 10000
  max_connections_per_address: 10000
  connect_rate: 1000000
  connect_burst: 100000
`

func main() {
	tandemBin := flag.String("tandem", "bin/tandem", "tandem binary")
	reps := flag.Int("reps", 3, "runs of each workload per broker (the median is shown)")
	only := flag.String("only", "", "comma-separated workloads to run (default all)")
	clusters := flag.Bool("clusters", true, "also run the cluster workloads (2 and 3 gateways on loopback)")
	onlyClusters := flag.String("only-clusters", "", "comma-separated cluster workloads to run, by their first word (C1, the reference, always runs); with it, the single-gateway workloads are skipped")
	storageRuns := flag.Bool("storage", true, "also run the storage workloads (R1, R2, R3: retention dropping against an empty log; F1: flush interval on slow flash against on this disk; F2, F3: flush interval against always on slow flash)")
	onlyStorage := flag.String("only-storage", "", "comma-separated storage workloads to run (R1,R2,R3,F1,F2,F3); with it, the other workloads are skipped")
	flag.Parse()

	// W6 holds 5,000 connections on each side: the brokers started below
	// inherit this limit.
	check(bench.RaiseFileLimit(16384))
	dir, err := os.MkdirTemp("", "tandem-bench-")
	check(err)
	defer os.RemoveAll(dir)
	dev := deviceStat(dir)

	tan := startTandem(*tandemBin, dir)
	defer func() { stop(tan) }()
	mos := startMosquitto(dir)
	defer func() { stop(mos) }()

	fmt.Printf("machine: %d CPUs, %s; device counters: %s\n", numCPU(), cpuModel(), dev)
	fmt.Printf("tandem %s vs mosquitto %s, %d runs each, A B A B …, medians\n", tan.addr, mos.addr, *reps)
	fmt.Printf("W5: msg/s is deliveries/s to all subscribers, p50/p99 end to end, µs per delivery\n\n")
	fmt.Printf("%-4s %-9s %10s %9s %9s %9s %10s %11s %8s  %s\n", "", "broker", "msg/s", "p50 ms", "p99 ms", "µs/msg", "fsync/msg", "dev B/msg", "RSS MB", "ratio (goal)")
	for _, w := range workloads {
		if (*only != "" || *onlyClusters != "" || *onlyStorage != "") && !slices.Contains(strings.Split(*only, ","), w.name) {
			continue
		}
		var st, sm []sample
		for r := 0; r < *reps; r++ {
			st = append(st, runOn(&tan, w, dev))
			sm = append(sm, runOn(&mos, w, dev))
		}
		switch {
		case w.o.Idle > 0:
			a, b := medianBy(st, func(s sample) float64 { return s.rssMB }), medianBy(sm, func(s sample) float64 { return s.rssMB })
			printIdleRow(w.name, "tandem", a)
			printIdleRow("", "mosquitto", b)
			fmt.Printf("%-4s %-9s %10s  tandem/mosquitto = %.2f× RSS; tandem %.1f MB with %d idle connections (%s)\n\n", "", "", "", a.rssMB/b.rssMB, a.rssMB, w.o.Idle, w.goal+notComparable(a, b))
		case w.o.Subscribers > 0:
			a, b := medianBy(st, deliveriesPerSec), medianBy(sm, deliveriesPerSec)
			printFanOutRow(w.name, "tandem", a)
			printFanOutRow("", "mosquitto", b)
			fmt.Printf("%-4s %-9s %10s  tandem/mosquitto = %.2f× deliveries/s to %d QoS %d subscribers (%s)\n\n", "", "", "", a.res.DeliveriesPerSec/b.res.DeliveriesPerSec, w.o.Subscribers, w.o.SubscribeQoS, w.goal+notComparable(a, b))
		default:
			a, b := median(st), median(sm)
			printRow(w.name, "tandem", a)
			printRow("", "mosquitto", b)
			fmt.Printf("%-4s %-9s %10s  tandem/mosquitto = %.2f× msg/s (%s)\n\n", "", "", "", a.res.MsgPerSec/b.res.MsgPerSec, w.goal+notComparable(a, b))
		}
	}
	stop(tan)
	stop(mos)
	if *storageRuns && (*onlyClusters == "" && *only == "" || *onlyStorage != "") {
		runStorage(*tandemBin, dir, dev, *reps, *onlyStorage)
	}
	if *clusters && *onlyStorage == "" {
		runClusters(*tandemBin, dir, *reps, *onlyClusters)
	}
}

func printRow(w, name string, s sample) {
	fmt.Printf("%-4s %-9s %10.0f %9.3f %9.3f %9.1f %10.3f %11.0f %8.1f%s\n", w, name, s.res.MsgPerSec, s.res.AckP50Ms, s.res.AckP99Ms, s.cpuUsPerMsg, s.fsyncsPerMsg, s.devBytesPerMsg, s.rssMB, failedMark(s))
	printKernelRow("msg", s.kernel)
	printWrittenRow("msg", s)
}

// printWrittenRow is the line under tandem's row that takes dev B/msg
// apart: what its storage layer wrote per message, by file, and what the
// device wrote beyond it: the file system's journal and metadata, the
// gateway's log, and any other writer on the device (Mosquitto's dev
// B/msg, which writes nothing, shows those). /proc/PID/io write_bytes is
// no help: on kernels with large folios (6.18) it counts the whole folio a
// write dirties (1 MiB for a 100-byte pwrite into a 1 MiB file) where the
// device writes the page.
func printWrittenRow(per string, s sample) {
	if !s.hasWritten {
		return
	}
	w := s.written
	fmt.Printf("%-4s %-9s per %s: storage wrote %.0f B (WAL %.0f, data %.0f, snapshot %.0f); the device %.0f B more\n",
		"", "", per, w.Total(), w.WAL, w.Data, w.Snapshot, s.devBytesPerMsg-w.Total())
}

func printFanOutRow(w, name string, s sample) {
	fmt.Printf("%-4s %-9s %10.0f %9.3f %9.3f %9.1f %10.3f %11.0f %8.1f%s\n", w, name, s.res.DeliveriesPerSec, s.res.E2EP50Ms, s.res.E2EP99Ms, s.cpuUsPerMsg, s.fsyncsPerMsg, s.devBytesPerMsg, s.rssMB, failedMark(s))
	printKernelRow("delivery", s.kernel)
	printWrittenRow("delivery", s)
}

// printKernelRow is the line under a broker's row: its kernel work per
// message (per delivery).
func printKernelRow(per string, k kernelWork) {
	fmt.Printf("%-4s %-9s per %s: %.2f read, %.2f write syscalls; %.2f voluntary (wake-ups), %.2f involuntary context switches\n",
		"", "", per, k.reads, k.writes, k.voluntary, k.involuntary)
}

func printIdleRow(w, name string, s sample) {
	perConn := (s.rssMB - s.rssBeforeMB) * 1024 / float64(max(s.res.Idle, 1))
	started := "restarted" // Mosquitto runs in memory
	if name == "tandem" {
		started = "restarted on W1-W5's log"
	}
	fmt.Printf("%-4s %-9s %8.1f MB RSS with %d idle (%.1f MB before, %s: %.1f KiB/connection), connected in %.2f s%s\n",
		w, name, s.rssMB, s.res.Idle, s.rssBeforeMB, started, perConn, s.res.IdleConnectSeconds, failedMark(s))
}

// notComparable says when a ratio compares a failed run.
func notComparable(a, b sample) string {
	switch {
	case a.failed && b.failed:
		return "; not comparable: both failed"
	case a.failed:
		return "; not comparable: tandem failed"
	case b.failed:
		return "; not comparable: mosquitto failed"
	}
	return ""
}

func failedMark(s sample) string {
	if s.failed {
		return "  (failed: see above)"
	}
	return ""
}

func deliveriesPerSec(s sample) float64 { return s.res.DeliveriesPerSec }

func median(ss []sample) sample {
	return medianBy(ss, func(s sample) float64 { return s.res.MsgPerSec })
}

// medianBy returns the sample with the median key.
func medianBy(ss []sample, key func(sample) float64) sample {
	slices.SortFunc(ss, func(a, b sample) int {
		switch {
		case key(a) < key(b):
			return -1
		case key(a) > key(b):
			return 1
		}
		return 0
	})
	return ss[len(ss)/2]
}

// runOn runs w once on *b; when the run failed it starts the broker
// again for the next one.
func runOn(b **broker, w workload, dev string) sample {
	var s sample
	if w.o.Idle > 0 {
		// A new process, started again on the data W1-W5 left, as a
		// gateway restarts on its log: one that has just served them
		// holds the heap they grew, which the idle connections then fit
		// in (0 KiB each). Open reads the whole data file, and must leave
		// none of it in RSS (160 MB before the first connection, until
		// storage released those pages).
		stop(*b)
		*b = (*b).start()
		s = runIdle(*b, w)
	} else {
		s = run(*b, w, dev)
	}
	if s.failed {
		fmt.Fprintf(os.Stderr, "%s on %s failed: restarting %s\n", w.name, (*b).name, (*b).name)
		stop(*b)
		*b = (*b).start()
	}
	return s
}

func run(b *broker, w workload, dev string) sample {
	o := w.o
	o.Broker = b.addr
	o.Topic = "bench/" + w.name + "/%c"
	o.Version = 5
	cpu0 := procCPU(b.cmd.Process.Pid)
	k0 := procKernel(b.cmd.Process.Pid)
	fsyncs0 := tandemFsyncs(b)
	written0, werr := tandemWritten(b)
	dev0 := deviceBytes(dev)
	ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
	defer cancel()
	res, err := bench.Run(ctx, o)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s on %s: %v\n", w.name, b.name, err)
		return sample{res: &bench.Result{}, failed: true}
	}
	s := sample{res: res}
	if res.Failed > 0 {
		fmt.Fprintf(os.Stderr, "%s on %s: %d failed: %s\n", w.name, b.name, res.Failed, res.FirstFailure)
		s.failed = true
	}
	if o.Subscribers > 0 && res.ReceivedMin < res.Acked {
		fmt.Fprintf(os.Stderr, "%s on %s: a subscriber got %d of %d publishes (%d deliveries in all)\n", w.name, b.name, res.ReceivedMin, res.Acked, res.Received)
		s.failed = true
	}
	cpu := procCPU(b.cmd.Process.Pid) - cpu0
	per := float64(res.Acked)
	if o.Subscribers > 0 {
		per = float64(res.Received)
	}
	s.cpuUsPerMsg = cpu * 1e6 / per
	s.kernel = procKernel(b.cmd.Process.Pid).since(k0, per)
	s.fsyncsPerMsg = float64(tandemFsyncs(b)-fsyncs0) / float64(res.Acked)
	s.devBytesPerMsg = float64(deviceBytes(dev)-dev0) / float64(res.Acked)
	if written1, err := tandemWritten(b); err == nil && werr == nil {
		// Per acked message, as dev B/msg, also for fan-out.
		s.written, s.hasWritten = written1.Sub(written0).Per(res.Acked), true
	}
	s.rssMB = procRSS(b.cmd.Process.Pid)
	return s
}

// runIdle opens w.o.Idle idle connections to b, reads b's RSS once every
// CONNACK is in, and closes them.
func runIdle(b *broker, w workload) sample {
	o := w.o
	o.Broker = b.addr
	o.Version = 5
	s := sample{res: &bench.Result{Idle: o.Idle}, rssBeforeMB: procRSS(b.cmd.Process.Pid)}
	ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
	defer cancel()
	t0 := time.Now()
	ic, err := bench.OpenIdle(ctx, o, o.Idle)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s on %s: %v\n", w.name, b.name, err)
		s.failed = true
		return s
	}
	s.res.IdleConnectSeconds = time.Since(t0).Seconds()
	s.rssMB = procRSS(b.cmd.Process.Pid)
	s.res.IdleOpen = ic.Open()
	ic.Close()
	if s.res.IdleOpen != o.Idle {
		fmt.Fprintf(os.Stderr, "%s on %s: %d of %d connections were dropped\n", w.name, b.name, o.Idle-s.res.IdleOpen, o.Idle)
		s.failed = true
	}
	return s
}

func startTandem(bin, dir string) *broker {
	return startTandemAs(bin, dir, "tandem", "", nil)
}

// startTandemAs starts a gateway named name (its data dir, config and log
// in dir carry the name) with extra appended to the suite's config and env
// added to its environment.
func startTandemAs(bin, dir, name, extra string, env []string) *broker {
	mq, hp := freePort(), freePort()
	cfg := filepath.Join(dir, name+".yaml")
	check(os.WriteFile(cfg, []byte(fmt.Sprintf(tandemConfig, filepath.Join(dir, name+"-data"))+extra), 0o644))
	cmd := exec.Command(bin, "run", "--config", cfg, "--mqtt", mq, "--http", hp, "--peer", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), env...)
	logf, err := os.OpenFile(filepath.Join(dir, name+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	check(err)
	cmd.Stdout, cmd.Stderr = logf, logf
	check(cmd.Start())
	b := &broker{name: name, addr: mq, cmd: cmd, http: hp, start: func() *broker { return startTandemAs(bin, dir, name, extra, env) }}
	waitListening(mq)
	return b
}

func startMosquitto(dir string) *broker {
	port := freePort()
	_, p, _ := net.SplitHostPort(port)
	conf := filepath.Join(dir, "mosquitto.conf")
	check(os.WriteFile(conf, []byte(fmt.Sprintf("listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nmax_inflight_messages 0\nmax_queued_messages 100000\nconnection_messages false\n", p)), 0o644))
	cmd := exec.Command("mosquitto", "-c", conf)
	logf, err := os.OpenFile(filepath.Join(dir, "mosquitto.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	check(err)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "mosquitto is needed for the comparison: apt-get install mosquitto")
		os.Exit(1)
	}
	waitListening(port)
	return &broker{name: "mosquitto", addr: port, cmd: cmd, start: func() *broker { return startMosquitto(dir) }}
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

// tandemWritten reads what b's storage layer wrote so far (its /metrics);
// an error for Mosquitto.
func tandemWritten(b *broker) (bench.StorageWritten, error) {
	if b.http == "" {
		return bench.StorageWritten{}, fmt.Errorf("%s has no metrics", b.name)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return bench.ReadStorageWritten(ctx, b.http)
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

// kernelWork is a process's kernel work: syscalls that read and write
// (any fd: sockets, files, eventfds) and context switches of all its
// threads. As a difference over a run divided by its messages (since), the
// same per message.
type kernelWork struct {
	reads, writes          float64
	voluntary, involuntary float64
}

// procKernel reads pid's kernelWork: /proc/PID/io counts the whole thread
// group (exited threads included); context switches are per thread, so
// they are summed over /proc/PID/task (a thread that exited meanwhile
// takes its count with it: Go and Mosquitto keep theirs).
func procKernel(pid int) kernelWork {
	var k kernelWork
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid)); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			name, v, _ := strings.Cut(l, ":")
			n, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			switch name {
			case "syscr":
				k.reads = n
			case "syscw":
				k.writes = n
			}
		}
	}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			name, v, _ := strings.Cut(l, ":")
			n, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			switch name {
			case "voluntary_ctxt_switches":
				k.voluntary += n
			case "nonvoluntary_ctxt_switches":
				k.involuntary += n
			}
		}
	}
	return k
}

// since is the work done from k0 to k, divided by n.
func (k kernelWork) since(k0 kernelWork, n float64) kernelWork {
	if n <= 0 {
		return kernelWork{}
	}
	return kernelWork{
		reads:       (k.reads - k0.reads) / n,
		writes:      (k.writes - k0.writes) / n,
		voluntary:   (k.voluntary - k0.voluntary) / n,
		involuntary: (k.involuntary - k0.involuntary) / n,
	}
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
