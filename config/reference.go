package config

// Reference is the configuration reference, one row per key or group of
// keys: docs/configuration.md's table is generated from it (`make docs`),
// and the tests hold it to the schema: every yaml key of Config is in a
// row, every key a row names is one of Config's, and a default a row
// gives as a value is DefaultConfig's. Default and Meaning are markdown.
// Keys may be patterns ("mqtt.max_topic_*"), a name relative to the one
// before (".tls" after "mqtt.websocket.listen"), or a list ("uplinks"),
// whose fields Meaning then names.
var Reference = []KeyDoc{
	{
		Keys:    []string{"node.name"},
		Default: "host name",
		Meaning: "name shown in status and to peers",
	},
	{
		Keys:    []string{"node.data_dir"},
		Default: "`./tandem-data`",
		Meaning: "the log, the node key and certificate",
	},
	{
		Keys:    []string{"mqtt.listen"},
		Default: "`127.0.0.1:1883`",
		Meaning: "MQTT listener; a non-loopback one needs `users_file` or `allow_anonymous: true`",
	},
	{
		Keys:    []string{"mqtt.allow_anonymous"},
		Default: "`false`",
		Meaning: "admit clients without credentials on a non-loopback listener",
	},
	{
		Keys:    []string{"mqtt.users_file", "mqtt.acl_file"},
		Default: "—",
		Meaning: "users (`tandem passwd`) and Mosquitto-style ACLs, reloaded on SIGHUP; see [Securing a gateway](security.md)",
	},
	{
		Keys:    []string{"mqtt.tls.*"},
		Default: "off",
		Meaning: "TLS listener (`:8883`), client certificates; see [Securing a gateway](security.md)",
	},
	{
		Keys:    []string{"mqtt.max_inflight"},
		Default: "`1024`",
		Meaning: "receive maximum: unacked QoS 1/2 publishes per client",
	},
	{
		Keys:    []string{"mqtt.max_queued", "mqtt.max_queued_bytes", "mqtt.queue_full", "mqtt.max_inflight_out", "mqtt.max_inflight_out_bytes"},
		Default: "`1000`, `4MiB`, `read_log`, `100`, `4MiB`",
		Meaning: "per subscriber: messages queued for it, what happens past them (`read_log`: it reads the rest from the log; `disconnect`), and QoS 1/2 messages sent and not yet acked; see [Limits and budgets](limits.md)",
	},
	{
		Keys:    []string{"mqtt.max_packet_size", "mqtt.max_clients", "mqtt.max_client_id_length", "mqtt.max_connections_per_*", "mqtt.max_topic_*", "mqtt.connect_*", "mqtt.keepalive_*", "mqtt.max_filters_per_session", "mqtt.max_retained", "mqtt.max_retained_bytes", "mqtt.max_sessions", "mqtt.max_session_bytes", "mqtt.topic_alias_maximum"},
		Default: "`1MiB`, `1000`, …",
		Meaning: "limits; see [Limits and budgets](limits.md)",
	},
	{
		Keys:    []string{"mqtt.reason_strings"},
		Default: "`minimal`",
		Meaning: "`minimal`: a Reason String only in CONNACK and DISCONNECT, acks (PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK) carry the bare reason code, as Mosquitto's; `all`: in acks too. The log says the reason either way",
	},
	{
		Keys:    []string{"mqtt.websocket.listen", ".tls", ".origins"},
		Default: "off, —, —",
		Meaning: "MQTT over WebSocket for browser dashboards; a non-loopback one needs `users_file` or `allow_anonymous: true`. `origins`: which browser pages may connect (see \"MQTT features\" in [acks.md](acks.md); with credentials required, every page)",
	},
	{
		Keys:    []string{"limits.memory"},
		Default: "`256MiB`, at least `16MiB`",
		Meaning: "what clients may make the gateway hold in memory; see [Limits and budgets](limits.md)",
	},
	{
		Keys:    []string{"peer.listen", "peer.advertise"},
		Default: "`127.0.0.1:7883` (packaged config: `:7883`), found at run time",
		Meaning: "gateway-to-gateway listener; the addresses other gateways dial",
	},
	{
		Keys:    []string{"peer.max_strangers", "peer.max_strangers_per_address"},
		Default: "`64`, `2`",
		Meaning: "peer port connections not yet proven a member's (join and pairing knocks), in all and per address; see [Limits and budgets](limits.md) and [Securing a gateway](security.md)",
	},
	{
		Keys:    []string{"http.listen"},
		Default: "`127.0.0.1:7880`",
		Meaning: "status and control API",
	},
	{
		Keys:    []string{"http.token_file"},
		Default: "`DATA/http-token`, written at first start",
		Meaning: "bearer token the API's commands need (the CLI finds it)",
	},
	{
		Keys:    []string{"http.allowed_hosts"},
		Default: "—",
		Meaning: "DNS names, besides loopback, the host name and addresses, a request may name in `Host`",
	},
	{
		Keys:    []string{"http.max_conns", "http.max_conns_per_address", "http.idle_timeout"},
		Default: "`64`, `8`, `10s`",
		Meaning: "connections from other hosts at once, from one of them, and how long a kept-alive one may idle; loopback has 8 slots past `max_conns`",
	},
	{
		Keys:    []string{"mqtt.tls.min_version"},
		Default: "`\"1.2\"`",
		Meaning: "`\"1.3\"` refuses TLS 1.2 on the MQTT TLS listener",
	},
	{
		Keys:    []string{"log.level", "log.format"},
		Default: "`info`, `text`",
		Meaning: "`debug`/`info`/`warn`/`error`; `text` or `json`",
	},
	{
		Keys:    []string{"cluster.sync_timeout"},
		Default: "`5s`",
		Meaning: "how long a `sync` publish waits for its slaves",
	},
	{
		Keys:    []string{"cluster.min_sync_replicas"},
		Default: "`1`",
		Meaning: "slaves that must hold a `sync` record (1 or 2)",
	},
	{
		Keys:    []string{"cluster.heartbeat", "cluster.election_timeout"},
		Default: "`100ms`, `1s`",
		Meaning: "raft timing",
	},
	{
		Keys:    []string{"cluster.failover", "cluster.failover_after"},
		Default: "`manual`, `10s`",
		Meaning: "2-gateway failover: `tandem promote` by hand, or `auto` after that long with nothing from the master and no answer to a probe; see [When the master fails](clusters.md#when-the-master-fails)",
	},
	{
		Keys:    []string{"storage.flush"},
		Default: "`always`",
		Meaning: "`always`: fsync each batch before its acks; `interval` (RocketMQ's ASYNC_FLUSH): ack once the batch is written, fsync every `flush_interval`: a process crash (kill -9) loses nothing, a power cut up to one interval of acked records (raft's term and vote are still fsynced before use)",
	},
	{
		Keys:    []string{"storage.max_bytes"},
		Default: "`256MiB` (packaged config: `1GiB`), at least `8MiB`",
		Meaning: "the data dir's budget, WAL and data file: the oldest records are dropped, whole runs of a few KiB at a time, so the data dir stays within it plus 2MiB (bbolt reuses the freed pages; the data file stops growing at about the budget less the 2MiB WAL). The broker state counts too: retained messages and session state take their share of the budget from the log. Records over about 2 KB are stored in pieces of a page, which fit the pages retention frees: an 8MiB budget stays within its slack plus one record with records of 256 KiB or 1 MiB (the WAL takes the record that crosses its threshold before a checkpoint empties it). Exceptions: with records of a MiB the WAL grows to hold them ahead of a checkpoint, and retained messages of tens of KiB or more are kept whole in runs of pages that free space does not always fit (the hostile-device suite, 1 MB records and 100 KB retained messages on a 64MiB budget: up to 10MiB past it); while a member pulls a snapshot larger than 4MiB the master keeps it in the data dir as `snapshot.tsnp` for up to two minutes, beside the budget. Never what a live member of the cluster still lacks: when only such records are left, publishes are refused (MQTT 5 reason 0x97 quota exceeded; 3.1.1 clients are disconnected), status shows why in `storage.refusing` (null while publishes are taken) and the log says so, until that member catches up or is removed (right after a restart or an election the master knows no member's progress yet, so on a full log it may refuse for a heartbeat or two). A member that has not answered for ten election timeouts (10 s by default) holds nothing any more: once the log has passed it, it gets a snapshot of the broker state when it returns (or joins): members, persistent sessions and their cursors, retained messages, uplink positions (a snapshot of any size: one over 4MiB it pulls from the master in chunks of 1MiB, at most 10 a second, resuming after a cut link). Installing it keeps to the budget plus 2MiB as well: the member first drops its log up to its applied index (the snapshot supersedes it), then holds, beside its own broker state, only the part of the snapshot's that differs from it (received, then written in place; a joiner's, all new, is received whole and moved in place). A member that was away a while differs little (a 7 MB state on a 16MiB budget: its data dir did not grow). Once that part passes a quarter of the member's own state or 1/64 of the budget (512KiB at least), the member writes the snapshot's over its own as it arrives instead, so it holds the state once, plus that part at most (all of a 7 MB state replaced, or 7 MB of an 11 MB one: its data dir did not grow either); until that install ends its broker state is incomplete (status `log.catching_up` is true, and the member applies nothing to it, takes no devices (it sends them to the other members, MQTT 5 CONNACK 0x9C with a Server Reference, or refuses them, 0x88, when it can name none; `/healthz` says why; a lone gateway's operator can accept the state as it is: `tandem repair --accept-incomplete`), stands for no election and refuses `tandem promote`; a member stopped meanwhile, once started again, refuses the master's entries and asks for its snapshot, even from a master whose log still holds what it lacks; `mqtt.max_retained_bytes` counts what retained messages take in the data file, pages included). Then it pulls the records before the snapshot that the master still holds, newest first, in chunks of 256KiB at most 10 a second, into the space the old state freed, and within the budget (retention drops them first, oldest first, which ends the pull) (status `log.catching_up` is true meanwhile and `log.catch_up` counts `records_pulled`, `bytes_pulled` and `records_left`, -1 until the master first answers; `tandem cluster join` shows the history coming in, the snapshot and then these records, as a progress bar with rate and ETA until it ends; a restart resumes the pull); a session resuming there from before them starts at the oldest one pulled. `log.first_index` in status moves as records go; a session replaying from before it starts at the oldest kept record",
	},
	{
		Keys:    []string{"storage.max_age"},
		Default: "off",
		Meaning: "records older than this are dropped too, whole runs at a time. Ages, like message expiry, are measured on the gateway's clock: a jump of the wall clock (a board without a real-time clock when NTP syncs, a date set by hand; over 1 s beyond what the monotonic clock measured) is logged (\"the wall clock jumped\"), counted in `tandem_clock_jumps_total` and absorbed, so it drops or expires nothing a correct clock would keep; the offset (`tandem_clock_offset_seconds`) is kept in the data dir across restarts, and a host booting with its clock behind the data dir's last checkpoint starts from there",
	},
	{
		Keys:    []string{"storage.min_free"},
		Default: "5 % of the filesystem or `256MiB`, whichever is smaller",
		Meaning: "below this much free space on the data dir's filesystem (read every second), publishes are refused with MQTT 5 reason 0x97 (3.1.1 clients are disconnected), whoever filled the disk; subscribers are still served, the log and status (`storage.refusing`, in red on the page) say why, and publishes are taken again by themselves once space returns",
	},
	{
		Keys:    []string{"storage.flush_interval"},
		Default: "`200ms`",
		Meaning: "the fsync period of `flush: interval`",
	},
	{
		Keys:    []string{"storage.on_damage"},
		Default: "`resync`",
		Meaning: "what a cluster member does when its data file fails its checks at start (a record's CRC, a torn meta page, a truncated file): `resync` moves the damaged files aside (never deleted), rejoins the cluster under a fresh member id and re-syncs the whole log from the master; `refuse` stops with the error, as before. A lone gateway always refuses (nobody to heal from); see [A damaged member heals from its peers](clusters.md#a-damaged-member-heals-from-its-peers)",
	},
	{
		Keys:    []string{"topics"},
		Default: "all `async`",
		Meaning: "ordered list of `{match: FILTER, ack: sync|async}`; first match wins",
	},
	{
		Keys:    []string{"discovery.mdns", "discovery.interface"},
		Default: "`false`, all",
		Meaning: "announce and browse over mDNS (through avahi-daemon where it runs)",
	},
	{
		Keys:    []string{"uplinks"},
		Default: "none",
		Meaning: "cloud brokers the master forwards the log to: `name`, `broker` (`tcp://` or `tls://host:port`), `protocol` (`5` or `3.1.1`), `client_id`, `username`, `password_file`, `tls` {`ca_file`, `cert_file`, `key_file`}, `topics` [{`match`, `remote_prefix`, `qos`}], `downlink` [{`remote`, `local_prefix`, `qos`}], `max_inflight` (`64`), `rate` (msg/s, `0` = no cap), `max_backlog` (half of `storage.max_bytes`), `on_full` (`refuse` or `drop_oldest`), `keepalive` (`30s`), `reconnect_min`, `reconnect_max` (`1s`, `2m`); see [Sending data to the cloud](uplink.md)",
	},
}

// KeyDoc is one row of the configuration reference.
type KeyDoc struct {
	// Keys are the keys the row documents, as a user writes them.
	Keys []string
	// Default is the default, in markdown: a value in backquotes, or
	// words ("host name", "off").
	Default string
	// Meaning says what the keys do, in markdown.
	Meaning string
}
