package mqtt

import (
	"encoding"
	"encoding/binary"
	"strconv"
	"strings"
	"time"

	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/storage"
	"github.com/mochi-mqtt/server/v2/packets"
)

// SessionStore keeps the broker's persistent state: sessions of clients that
// asked for one, their subscriptions and in-flight messages, and retained
// messages. The daemon backs it with the data file, where Put and Delete are
// staged and become durable with the next log commit.
type SessionStore interface {
	// Put stages key=value. value is not modified afterwards.
	Put(key string, value []byte)
	// Delete stages the removal of key.
	Delete(key string)
	// Sync makes everything staged so far durable before it returns.
	Sync() error
	// Load calls fn for every key with prefix, in key order.
	Load(prefix string, fn func(key string, value []byte) error) error
}

// Key prefixes; NUL separates parts because client ids and filters may
// contain any other character.
const (
	prefixClient   = "c\x00"
	prefixSub      = "s\x00"
	prefixInflight = "i\x00"
	prefixRetained = "r\x00"
	prefixQoS2     = "q\x00" // inbound QoS 2 publishes awaiting PUBREL
)

// persist is the mochi hook that mirrors session state into a SessionStore,
// in the manner of mochi's own storage hooks but without an fsync per event:
// writes are staged and ride on the log's commits.
type persist struct {
	mochi.HookBase
	store SessionStore
	b     *Broker
}

func (h *persist) ID() string { return "tandem-persist" }

func (h *persist) Provides(b byte) bool {
	switch b {
	case mochi.OnSessionEstablished, mochi.OnDisconnect, mochi.OnSubscribed, mochi.OnUnsubscribed,
		mochi.OnRetainMessage, mochi.OnQosPublish, mochi.OnQosComplete, mochi.OnQosDropped,
		mochi.OnClientExpired, mochi.OnRetainedExpired, mochi.OnWillSent,
		mochi.StoredClients, mochi.StoredSubscriptions, mochi.StoredInflightMessages, mochi.StoredRetainedMessages:
		return h.store != nil
	}
	return false
}

// durable reports whether cl's session outlives its connection; only such
// sessions are worth writing down.
func durable(cl *mochi.Client) bool {
	if cl.Net.Inline {
		return false
	}
	if cl.Properties.ProtocolVersion == 5 {
		return cl.Properties.Props.SessionExpiryInterval > 0
	}
	return !cl.Properties.Clean
}

func (h *persist) put(key string, v encoding.BinaryMarshaler) {
	b, err := v.MarshalBinary()
	if err != nil {
		h.b.logger.Error("encoding session state failed", "key", key, "error", err)
		return
	}
	h.store.Put(key, b)
}

func (h *persist) OnSessionEstablished(cl *mochi.Client, _ packets.Packet) {
	if !durable(cl) {
		// A clean start discards any earlier session of this id.
		h.deleteClient(cl.ID)
		return
	}
	h.putClient(cl)
	// Connects are rare: make the session durable before the client
	// relies on it (its CONNACK went out just before this hook).
	if err := h.store.Sync(); err != nil {
		h.b.logger.Error("saving the session failed", "client", cl.ID, "error", err)
	}
}

func (h *persist) OnWillSent(cl *mochi.Client, _ packets.Packet) {
	if durable(cl) {
		h.putClient(cl)
	}
}

func (h *persist) putClient(cl *mochi.Client) {
	p := cl.Properties.Props.Copy(false)
	h.put(prefixClient+cl.ID, &storage.Client{
		ID:              cl.ID,
		T:               storage.ClientKey,
		Remote:          cl.Net.Remote,
		Listener:        cl.Net.Listener,
		Username:        cl.Properties.Username,
		Clean:           cl.Properties.Clean,
		ProtocolVersion: cl.Properties.ProtocolVersion,
		Properties: storage.ClientProperties{
			SessionExpiryInterval:     p.SessionExpiryInterval,
			SessionExpiryIntervalFlag: p.SessionExpiryIntervalFlag,
			AuthenticationMethod:      p.AuthenticationMethod,
			AuthenticationData:        p.AuthenticationData,
			RequestProblemInfo:        p.RequestProblemInfo,
			RequestProblemInfoFlag:    p.RequestProblemInfoFlag,
			RequestResponseInfo:       p.RequestResponseInfo,
			ReceiveMaximum:            p.ReceiveMaximum,
			TopicAliasMaximum:         p.TopicAliasMaximum,
			User:                      p.User,
			MaximumPacketSize:         p.MaximumPacketSize,
		},
		Will: storage.ClientWill(cl.Properties.Will),
	})
}

// deleteClient drops a session and everything hanging off it.
func (h *persist) deleteClient(id string) {
	h.store.Delete(prefixClient + id)
	for _, p := range []string{prefixSub, prefixInflight, prefixQoS2} {
		pre := p + id + "\x00"
		var keys []string
		_ = h.store.Load(pre, func(k string, _ []byte) error {
			keys = append(keys, k)
			return nil
		})
		for _, k := range keys {
			h.store.Delete(k)
		}
	}
}

func (h *persist) OnDisconnect(cl *mochi.Client, _ error, expire bool) {
	if expire && cl.StopCause() != packets.ErrSessionTakenOver {
		h.deleteClient(cl.ID)
	}
}

func (h *persist) OnClientExpired(cl *mochi.Client) { h.deleteClient(cl.ID) }

// OnSubscribed writes the subscriptions down before mochi sends the SUBACK:
// a device told it is subscribed stays subscribed across a crash.
func (h *persist) OnSubscribed(cl *mochi.Client, pk packets.Packet, codes []byte) {
	if !durable(cl) {
		return
	}
	for i, f := range pk.Filters {
		if i >= len(codes) || codes[i] >= packets.ErrUnspecifiedError.Code {
			continue
		}
		h.put(prefixSub+cl.ID+"\x00"+f.Filter, &storage.Subscription{
			ID: prefixSub + cl.ID + "\x00" + f.Filter, T: storage.SubscriptionKey, Client: cl.ID,
			Qos: codes[i], Filter: f.Filter, Identifier: f.Identifier, NoLocal: f.NoLocal,
			RetainHandling: f.RetainHandling, RetainAsPublished: f.RetainAsPublished,
		})
	}
	if err := h.store.Sync(); err != nil {
		h.b.logger.Error("saving subscriptions failed", "client", cl.ID, "error", err)
	}
}

func (h *persist) OnUnsubscribed(cl *mochi.Client, pk packets.Packet) {
	for _, f := range pk.Filters {
		h.store.Delete(prefixSub + cl.ID + "\x00" + f.Filter)
	}
}

// OnRetainMessage runs while a committed record is delivered, so the
// retained store on disk moves with the applied index.
func (h *persist) OnRetainMessage(_ *mochi.Client, pk packets.Packet, r int64) {
	key := prefixRetained + pk.TopicName
	if r == -1 {
		h.store.Delete(key)
		return
	}
	m := messageOf(pk, key, storage.RetainedKey, "")
	h.put(key, &m)
}

func inflightKey(client string, pid uint16) string {
	return prefixInflight + client + "\x00" + strconv.Itoa(int(pid))
}

func (h *persist) OnQosPublish(cl *mochi.Client, pk packets.Packet, _ int64, _ int) {
	if durable(cl) {
		h.inflightSet(cl, pk)
	}
}

// inflightSet stages an in-flight packet of a durable session.
func (h *persist) inflightSet(cl *mochi.Client, pk packets.Packet) {
	if h.store == nil || !durable(cl) {
		return
	}
	key := inflightKey(cl.ID, pk.PacketID)
	m := messageOf(pk, key, storage.InflightKey, cl.ID)
	h.put(key, &m)
}

// inflightDelete stages the removal of an in-flight packet.
func (h *persist) inflightDelete(client string, pid uint16) {
	if h.store != nil {
		h.store.Delete(inflightKey(client, pid))
	}
}

func (h *persist) OnQosComplete(cl *mochi.Client, pk packets.Packet) {
	h.inflightDelete(cl.ID, pk.PacketID)
	if pk.FixedHeader.Type == packets.Pubrel {
		h.qos2Delete(cl.ID, pk.PacketID)
	}
}

func qos2Key(client string, pid uint16) string {
	return prefixQoS2 + client + "\x00" + strconv.Itoa(int(pid))
}

// qos2Set stages the marker of an inbound QoS 2 publish of a durable
// session: the record it names (origin, seq) and when it arrived.
func (h *persist) qos2Set(cl *mochi.Client, pid uint16, origin, seq uint64) {
	if h.store == nil || !durable(cl) {
		return
	}
	var v [24]byte
	binary.BigEndian.PutUint64(v[0:], origin)
	binary.BigEndian.PutUint64(v[8:], seq)
	binary.BigEndian.PutUint64(v[16:], uint64(time.Now().Unix()))
	h.store.Put(qos2Key(cl.ID, pid), v[:])
}

// qos2Delete stages the removal of a QoS 2 marker.
func (h *persist) qos2Delete(client string, pid uint16) {
	if h.store != nil {
		h.store.Delete(qos2Key(client, pid))
	}
}

// storedQoS2 turns the QoS 2 markers whose records are in the log back into
// the PUBRECs mochi keeps in Inflight; a marker whose record never reached
// the log (a crash in between) is dropped, so the client's resend is logged.
func (h *persist) storedQoS2() ([]storage.Message, error) {
	type marker struct {
		key, client string
		pid         uint16
		origin, seq uint64
		created     int64
	}
	var ms []marker
	err := h.store.Load(prefixQoS2, func(k string, v []byte) error {
		parts := strings.Split(k, "\x00")
		if len(v) != 24 || len(parts) != 3 {
			return nil
		}
		pid, err := strconv.Atoi(parts[2])
		if err != nil {
			return nil
		}
		ms = append(ms, marker{k, parts[1], uint16(pid), binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:]), int64(binary.BigEndian.Uint64(v[16:]))})
		return nil
	})
	if err != nil || len(ms) == 0 {
		return nil, err
	}
	byOrigin := map[uint64][]uint64{}
	for _, m := range ms {
		byOrigin[m.origin] = append(byOrigin[m.origin], m.seq)
	}
	logged := map[[2]uint64]bool{}
	for origin, seqs := range byOrigin {
		got, err := h.b.log.Logged(origin, seqs)
		if err != nil {
			return nil, err
		}
		for s := range got {
			logged[[2]uint64{origin, s}] = true
		}
	}
	var out []storage.Message
	for _, m := range ms {
		if !logged[[2]uint64{m.origin, m.seq}] {
			h.store.Delete(m.key)
			continue
		}
		out = append(out, storage.Message{ID: m.key, T: storage.InflightKey, Client: m.client, PacketID: m.pid, Created: m.created,
			FixedHeader: packets.FixedHeader{Type: packets.Pubrec}})
	}
	return out, nil
}

func (h *persist) OnQosDropped(cl *mochi.Client, pk packets.Packet) {
	h.inflightDelete(cl.ID, pk.PacketID)
}

func (h *persist) OnRetainedExpired(topic string) { h.store.Delete(prefixRetained + topic) }

func messageOf(pk packets.Packet, id, typ, client string) storage.Message {
	p := pk.Properties.Copy(false)
	return storage.Message{
		ID: id, T: typ, Client: client, Origin: pk.Origin, FixedHeader: pk.FixedHeader,
		TopicName: pk.TopicName, Payload: pk.Payload, Created: pk.Created, PacketID: pk.PacketID,
		Properties: storage.MessageProperties{
			PayloadFormat: p.PayloadFormat, PayloadFormatFlag: p.PayloadFormatFlag,
			MessageExpiryInterval: p.MessageExpiryInterval, ContentType: p.ContentType,
			ResponseTopic: p.ResponseTopic, CorrelationData: p.CorrelationData,
			SubscriptionIdentifier: p.SubscriptionIdentifier, TopicAlias: p.TopicAlias, User: p.User,
		},
	}
}

func loadAll[T any, P interface {
	*T
	encoding.BinaryUnmarshaler
}](s SessionStore, prefix string) ([]T, error) {
	var out []T
	err := s.Load(prefix, func(_ string, v []byte) error {
		var x T
		if err := P(&x).UnmarshalBinary(v); err != nil {
			return err
		}
		out = append(out, x)
		return nil
	})
	return out, err
}

func (h *persist) StoredClients() ([]storage.Client, error) {
	return loadAll[storage.Client](h.store, prefixClient)
}

func (h *persist) StoredSubscriptions() ([]storage.Subscription, error) {
	return loadAll[storage.Subscription](h.store, prefixSub)
}

func (h *persist) StoredInflightMessages() ([]storage.Message, error) {
	out, err := loadAll[storage.Message](h.store, prefixInflight)
	if err != nil {
		return nil, err
	}
	q, err := h.storedQoS2()
	return append(out, q...), err
}

func (h *persist) StoredRetainedMessages() ([]storage.Message, error) {
	return loadAll[storage.Message](h.store, prefixRetained)
}
