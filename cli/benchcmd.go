package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/tandem-edge/tandem/bench"
	"github.com/tandem-edge/tandem/config"
)

// barAfter is how long a run goes before it shows a progress bar.
const barAfter = 2 * time.Second

func newBenchCmd() *cobra.Command {
	var o bench.Options
	var asJSON bool
	var metrics string
	var qos int
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Load-test an MQTT broker (tandem or any other)",
		Long: `Publish from --clients connections, each keeping --window publishes in flight,
and report throughput and ack latency. With --subscribe or --subscribers N, N
subscribers each receive every publish (fan-out) at --subscribe-qos, acking
what they get; deliveries per second and end-to-end latency are reported too.
--idle N first opens N idle connections (CONNECT, then only keep-alive) and
holds them through the run: with --clients 0 and --duration, just that, to
read the broker's memory per connection. Works against any MQTT 3.1.1 or 5
broker.`,
		Example: `  tandem bench --clients 50 --window 16 --count 2000
  tandem bench --count 5000 --window 16 --subscribers 20 --subscribe-qos 1
  tandem bench --clients 0 --idle 5000 --duration 60s`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if qos < 0 || qos > 2 {
				return config.UsageError{Err: fmt.Errorf("--qos must be 0, 1 or 2")}
			}
			o.QoS = byte(qos)
			if !cmd.Flags().Changed("subscribe-qos") {
				o.SubscribeQoS = qos
			}
			switch {
			case o.SubscribeQoS < 0 || o.SubscribeQoS > 2:
				return config.UsageError{Err: fmt.Errorf("--subscribe-qos must be 0, 1 or 2")}
			case o.SubscriberReceiveMax < 1 || o.SubscriberReceiveMax > 65535:
				return config.UsageError{Err: fmt.Errorf("--subscriber-receive-max must be 1 to 65535")}
			case o.Clients < 0 || o.Subscribers < 0 || o.Idle < 0:
				return config.UsageError{Err: fmt.Errorf("--clients, --subscribers and --idle cannot be negative")}
			case o.Clients == 0 && o.Idle == 0:
				return config.UsageError{Err: fmt.Errorf("--clients 0 needs --idle")}
			case o.Count < 0 || o.Duration < 0:
				return config.UsageError{Err: fmt.Errorf("--count and --duration cannot be negative")}
			case o.Clients > 0 && o.Count == 0 && o.Duration == 0:
				// bench.Run would fall back to 1000 publishes: not
				// what "--count 0" asked for.
				return config.UsageError{Err: fmt.Errorf("--count 0 runs for a time: add --duration (e.g. --duration 30s)")}
			}
			out := cmd.OutOrStdout()
			if f, ok := out.(*os.File); ok && !asJSON && o.Clients > 0 && term.IsTerminal(int(f.Fd())) {
				total := int64(-1)
				if o.Count > 0 {
					total = int64(o.Count * max(o.Clients, 1))
				}
				// Only a run that lasts gets a bar: one that ends within
				// barAfter would only flash it. Progress is called from
				// one goroutine at a time, and not after Run returns.
				start := time.Now()
				var bar *progressbar.ProgressBar
				o.Progress = func(n int64) {
					if bar == nil {
						if time.Since(start) < barAfter {
							return
						}
						bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(cmd.ErrOrStderr()),
							progressbar.OptionSetDescription("publishing"), progressbar.OptionShowCount(), progressbar.OptionShowIts(),
							progressbar.OptionClearOnFinish(), progressbar.OptionThrottle(100*time.Millisecond))
					}
					_ = bar.Set64(n)
				}
				defer func() {
					if bar != nil {
						_ = bar.Finish()
					}
				}()
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
			defer stop()
			var w0 bench.StorageWritten
			if metrics != "" {
				var err error
				if w0, err = bench.ReadStorageWritten(ctx, metrics); err != nil {
					return fmt.Errorf("--metrics: %w", err)
				}
			}
			res, err := bench.Run(ctx, o)
			if err != nil {
				return err
			}
			if metrics != "" {
				w1, err := bench.ReadStorageWritten(ctx, metrics)
				if err != nil {
					return fmt.Errorf("--metrics: %w", err)
				}
				per := w1.Sub(w0).Per(res.Acked)
				res.StorageWritten = &per
			}
			if asJSON {
				if err := json.NewEncoder(out).Encode(res); err != nil {
					return err
				}
			} else {
				printResult(out, &o, res)
			}
			return failedPublishes(res)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&o.Broker, "broker", "127.0.0.1:1883", "broker address host:port")
	fl.IntVar(&o.Clients, "clients", 1, "publishing connections")
	fl.IntVar(&o.Count, "count", 1000, "publishes per client (0: run for --duration)")
	fl.DurationVar(&o.Duration, "duration", 0, "run this long (with --count 0; with --clients 0, how long to hold --idle)")
	fl.IntVar(&qos, "qos", 1, "QoS of the publishes (0, 1, 2)")
	fl.IntVar(&o.Size, "size", 100, "payload size in bytes")
	fl.IntVar(&o.Window, "window", 1, "publishes in flight per client")
	fl.StringVar(&o.Topic, "topic", "bench/%c", "topic; %c is replaced by the client number")
	fl.IntVar(&o.Version, "mqtt-version", 5, "MQTT version: 3 (3.1.1) or 5")
	fl.BoolVar(&o.Subscribe, "subscribe", false, "also subscribe and time end-to-end delivery (--subscribers 1)")
	fl.IntVar(&o.Subscribers, "subscribers", 0, "subscribers that each receive every publish (fan-out)")
	fl.IntVar(&o.SubscribeQoS, "subscribe-qos", 0, "QoS of the subscriptions (0, 1, 2)")
	fl.Lookup("subscribe-qos").DefValue = "the --qos value"
	fl.IntVar(&o.SubscriberReceiveMax, "subscriber-receive-max", 20, "Receive Maximum the MQTT 5 subscribers send (QoS 1/2 deliveries unacked at once)")
	fl.IntVar(&o.Idle, "idle", 0, "idle connections (CONNECT, then only keep-alive) held open through the run")
	fl.StringVar(&o.Username, "username", "", "username")
	fl.StringVar(&o.Password, "password", "", "password")
	fl.StringVar(&metrics, "metrics", "", "a tandem gateway's HTTP address (its http.listen): also report what its storage layer wrote per acked publish, by file, from its /metrics (other writes on the gateway count too)")
	fl.BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}

func printResult(w io.Writer, o *bench.Options, r *bench.Result) {
	if r.Idle > 0 {
		fmt.Fprintf(w, "%d idle connections → %s\n", r.Idle, o.Broker)
		fmt.Fprintf(w, "  connected  in %.2fs; %d still open at the end\n", r.IdleConnectSeconds, r.IdleOpen)
	}
	if r.Clients > 0 {
		fmt.Fprintf(w, "%d clients × %s, QoS %d, %d B, window %d → %s\n", r.Clients, countOrDuration(o), r.QoS, r.Size, r.Window, o.Broker)
		fmt.Fprintf(w, "  acked      %d of %d in %.2fs (%d failed)\n", r.Acked, r.Sent, r.Seconds, r.Failed)
		fmt.Fprintf(w, "  throughput %.0f msg/s\n", r.MsgPerSec)
		fmt.Fprintf(w, "  ack        p50 %.3f ms  p99 %.3f ms  max %.3f ms\n", r.AckP50Ms, r.AckP99Ms, r.AckMaxMs)
	}
	if r.Subscribers > 0 {
		fmt.Fprintf(w, "  delivered  %d to %d subscribers (QoS %d subscriptions, up to QoS %d deliveries; fewest to one: %d of %d)\n",
			r.Received, r.Subscribers, r.SubscribeQoS, r.DeliveredQoS, r.ReceivedMin, r.Acked)
		fmt.Fprintf(w, "  fan-out    %.0f deliveries/s\n", r.DeliveriesPerSec)
		fmt.Fprintf(w, "  e2e        p50 %.3f ms  p99 %.3f ms  max %.3f ms\n", r.E2EP50Ms, r.E2EP99Ms, r.E2EMaxMs)
	}
	if sw := r.StorageWritten; sw != nil {
		fmt.Fprintf(w, "  storage    %.0f B written per publish (WAL %.0f, data %.0f, snapshot %.0f)\n", sw.Total(), sw.WAL, sw.Data, sw.Snapshot)
	}
	if r.FirstFailure != "" {
		fmt.Fprintf(w, "  first failure: %s\n", r.FirstFailure)
	}
}

// failedPublishes is the error that makes a run with failed publishes
// exit 1: a benchmark whose publishes were refused measured nothing, and
// scripts comparing brokers must not take its numbers.
func failedPublishes(r *bench.Result) error {
	if r.Failed == 0 {
		return nil
	}
	return fmt.Errorf("%d of %d publishes failed; first failure: %s", r.Failed, r.Sent, r.FirstFailure)
}

func countOrDuration(o *bench.Options) string {
	if o.Count > 0 {
		return fmt.Sprint(o.Count)
	}
	return o.Duration.String()
}
