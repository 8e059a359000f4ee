package replication

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// The peer protocol's framing. After the TLS handshake every byte on the
// peer port is a frame:
//
//	length uint32 (big-endian) | type byte | body
//
// where length counts the type byte and the body, so it is at least 1. A
// reader checks length against its limit before it allocates anything, so a
// hostile or corrupt length costs a closed connection, never memory.
//
// Bodies (integers big-endian):
//
//	hello     version u16 | purpose u8 | node id u64 | generation u64 | cluster len u8 | cluster
//	raft      count uvarint | count × (size uvarint | pb.Message, protobuf)
//	request   id u64 | timeout ms u32 (0: none) | kind u8 | payload
//	response  id u64 | status u8 (0 ok, 1 error) | reply, or the error's text
//	knock     kind u8 | payload         (a stranger's one request; answered by a response with id 0)
//	ping      empty                     (keeps an idle link's read deadline from firing)
//
// A hello may carry bytes after the cluster id: a later version may append
// fields there and an older reader ignores them.

// MaxFrameSize bounds a frame's length field on a member connection. A
// larger length closes the connection. It is well above raft's
// MaxSizePerMsg (1 MiB) so that a whole append batch fits in one frame.
const MaxFrameSize = 16 << 20

const (
	// peerProtocolMin and peerProtocolMax are the peer protocol versions
	// this build speaks. A hello's version field says the lowest (builds
	// before negotiation refuse any version but their own, 1), its
	// trailer the highest; the link speaks the highest both know, and a
	// peer whose range does not meet ours is refused (it logs why) rather
	// than misread (DESIGN.md, "Versions and upgrades"). peerProtocolMax
	// is in feature_default.go (feature_next.go in a tandem_next build).
	peerProtocolMin = 1

	// maxSmallFrame bounds every frame read before the other side is known
	// to be a member: hellos, knocks and whatever a stranger sends. A
	// stranger cannot make us allocate more than this.
	maxSmallFrame = 64 << 10

	frameHeaderLen = 5 // length u32 + type u8

	// helloLen is the fixed part of a hello body, before the cluster id.
	helloLen = 2 + 1 + 8 + 8 + 1

	// maxBatchBytes is where the writer starts a new raft frame: frames stay
	// small enough to interleave with requests and responses.
	maxBatchBytes = 1 << 20

	// maxRaftMsgSize is the largest single raft message that fits a frame
	// (type byte, two maximal uvarints).
	maxRaftMsgSize = MaxFrameSize - 1 - 2*binary.MaxVarintLen64
)

// Frame types.
const (
	frameHello    byte = 1
	frameRaft     byte = 2
	frameRequest  byte = 3
	frameResponse byte = 4
	frameKnock    byte = 5
	framePing     byte = 6
)

// Hello purposes: what the dialling side wants from the connection.
const (
	purposeLink  byte = 1 // a member link: raft, requests, responses
	purposeKnock byte = 2 // one stranger request, then the connection closes
)

// Response statuses.
const (
	statusOK    byte = 0
	statusError byte = 1
)

var (
	// ErrFrameTooLarge means a frame's length field exceeded the limit of
	// the connection; the connection is closed.
	ErrFrameTooLarge = errors.New("replication: peer frame too large")

	// errBadFrame means a frame could not be decoded; the connection is
	// closed (a member speaking nonsense is a bug, not something to skip).
	errBadFrame = errors.New("replication: malformed peer frame")
)

// frameReader reads frames from a connection, reusing one buffer.
type frameReader struct {
	r   *bufio.Reader
	max int // the largest length field accepted
	buf []byte
}

func newFrameReader(r io.Reader, max int) *frameReader {
	return &frameReader{r: bufio.NewReaderSize(r, 32<<10), max: max}
}

// next returns the next frame's type and body. The body is only valid until
// the next call: callers that keep it copy it.
func (fr *frameReader) next() (typ byte, body []byte, err error) {
	var hdr [4]byte
	if _, err := io.ReadFull(fr.r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n == 0 {
		return 0, nil, fmt.Errorf("%w: zero length", errBadFrame)
	}
	if uint64(n) > uint64(fr.max) {
		return 0, nil, fmt.Errorf("%w: %d bytes, limit %d", ErrFrameTooLarge, n, fr.max)
	}
	if cap(fr.buf) < int(n) || cap(fr.buf) > maxBatchBytes && int(n) <= maxBatchBytes {
		// Grow to fit, and give back a buffer a rare huge frame left
		// behind once ordinary frames resume.
		fr.buf = make([]byte, n)
	}
	b := fr.buf[:n]
	if _, err := io.ReadFull(fr.r, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return b[0], b[1:], nil
}

// appendFrame appends a whole frame of type typ to dst.
func appendFrame(dst []byte, typ byte, body []byte) []byte {
	dst = binary.BigEndian.AppendUint32(dst, uint32(1+len(body)))
	dst = append(dst, typ)
	return append(dst, body...)
}

// hello is the first frame each way after TLS (the server's only once it
// has admitted the dialler). It carries what a node must know about the
// other before any raft traffic: who it claims to be (checked against its
// certificate), its cluster generation and cluster id.
type hello struct {
	version uint16
	purpose byte
	id      uint64
	gen     uint64
	cluster string

	// The trailer, after the cluster id; builds before it neither send
	// nor read it, and decode as maxVersion = version, level =
	// storage.FeatureBase, build "".
	maxVersion uint16 // the highest protocol version the sender speaks
	level      byte   // the highest feature level its build knows
	build      string // its release (version.Version), for status
}

func appendHello(dst []byte, h hello) []byte {
	cl := h.cluster
	if len(cl) > 255 {
		cl = cl[:255] // the length is one byte; cluster ids are short
	}
	body := make([]byte, 0, helloLen+len(cl))
	body = binary.BigEndian.AppendUint16(body, h.version)
	body = append(body, h.purpose)
	body = binary.BigEndian.AppendUint64(body, h.id)
	body = binary.BigEndian.AppendUint64(body, h.gen)
	body = append(body, byte(len(cl)))
	body = append(body, cl...)
	build := h.build
	if len(build) > 255 {
		build = build[:255]
	}
	body = binary.BigEndian.AppendUint16(body, h.maxVersion)
	body = append(body, h.level, byte(len(build)))
	body = append(body, build...)
	return appendFrame(dst, frameHello, body)
}

func decodeHello(body []byte) (hello, error) {
	if len(body) < helloLen {
		return hello{}, fmt.Errorf("%w: hello of %d bytes", errBadFrame, len(body))
	}
	h := hello{
		version: binary.BigEndian.Uint16(body),
		purpose: body[2],
		id:      binary.BigEndian.Uint64(body[3:]),
		gen:     binary.BigEndian.Uint64(body[11:]),
	}
	n := int(body[19])
	if len(body) < helloLen+n {
		return hello{}, fmt.Errorf("%w: hello cluster id cut short", errBadFrame)
	}
	h.cluster = string(body[helloLen : helloLen+n])
	h.maxVersion, h.level = h.version, storage.FeatureBase
	if t := body[helloLen+n:]; len(t) >= 4 {
		h.maxVersion, h.level = binary.BigEndian.Uint16(t), t[2]
		if b := t[4:]; len(b) >= int(t[3]) {
			h.build = string(b[:t[3]])
		}
	}
	return h, nil
}

// appendRaftFrame appends one frame holding msgs, marshalled in place.
func appendRaftFrame(dst []byte, msgs []pb.Message) ([]byte, error) {
	start := len(dst)
	dst = append(dst, 0, 0, 0, 0, frameRaft)
	dst = binary.AppendUvarint(dst, uint64(len(msgs)))
	for i := range msgs {
		m := &msgs[i]
		sz := m.Size()
		dst = binary.AppendUvarint(dst, uint64(sz))
		at := len(dst)
		dst = slices.Grow(dst, sz)[:at+sz]
		if _, err := m.MarshalToSizedBuffer(dst[at : at+sz]); err != nil {
			return dst[:start], err
		}
	}
	n := len(dst) - start - 4
	if n > MaxFrameSize {
		return dst[:start], fmt.Errorf("%w: raft batch of %d bytes", ErrFrameTooLarge, n)
	}
	binary.BigEndian.PutUint32(dst[start:], uint32(n))
	return dst, nil
}

// decodeRaftBatch decodes a raft frame's body. The messages do not alias
// body: raftpb copies entry data out while unmarshalling.
func decodeRaftBatch(body []byte) ([]pb.Message, error) {
	count, n := binary.Uvarint(body)
	if n <= 0 {
		return nil, fmt.Errorf("%w: raft batch count", errBadFrame)
	}
	body = body[n:]
	// Every message takes at least its one-byte size, so a count larger
	// than the bytes left is a lie; checking it first keeps a hostile count
	// from sizing the slice.
	if count == 0 || count > uint64(len(body)) {
		return nil, fmt.Errorf("%w: raft batch of %d messages in %d bytes", errBadFrame, count, len(body))
	}
	msgs := make([]pb.Message, count)
	for i := range msgs {
		sz, n := binary.Uvarint(body)
		if n <= 0 || sz > uint64(len(body)-n) {
			return nil, fmt.Errorf("%w: raft message %d size", errBadFrame, i)
		}
		body = body[n:]
		if err := msgs[i].Unmarshal(body[:sz]); err != nil {
			return nil, fmt.Errorf("%w: raft message %d: %v", errBadFrame, i, err)
		}
		body = body[sz:]
	}
	if len(body) != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the raft batch", errBadFrame, len(body))
	}
	return msgs, nil
}

// requestFrame is a member request: one of many in flight on a connection,
// matched to its response by id.
type requestFrame struct {
	id        uint64
	timeoutMs uint32 // the requester's remaining patience; 0 for none
	kind      byte
	payload   []byte
}

func appendRequest(dst []byte, r requestFrame) []byte {
	dst = binary.BigEndian.AppendUint32(dst, uint32(1+8+4+1+len(r.payload)))
	dst = append(dst, frameRequest)
	dst = binary.BigEndian.AppendUint64(dst, r.id)
	dst = binary.BigEndian.AppendUint32(dst, r.timeoutMs)
	dst = append(dst, r.kind)
	return append(dst, r.payload...)
}

// decodeRequest decodes a request body; payload aliases body.
func decodeRequest(body []byte) (requestFrame, error) {
	if len(body) < 13 {
		return requestFrame{}, fmt.Errorf("%w: request of %d bytes", errBadFrame, len(body))
	}
	return requestFrame{
		id:        binary.BigEndian.Uint64(body),
		timeoutMs: binary.BigEndian.Uint32(body[8:]),
		kind:      body[12],
		payload:   body[13:],
	}, nil
}

// responseFrame answers a request (or, with id 0, a knock).
type responseFrame struct {
	id      uint64
	status  byte
	payload []byte // the reply, or the error's text
}

func appendResponse(dst []byte, r responseFrame) []byte {
	dst = binary.BigEndian.AppendUint32(dst, uint32(1+8+1+len(r.payload)))
	dst = append(dst, frameResponse)
	dst = binary.BigEndian.AppendUint64(dst, r.id)
	dst = append(dst, r.status)
	return append(dst, r.payload...)
}

// decodeResponse decodes a response body; payload aliases body.
func decodeResponse(body []byte) (responseFrame, error) {
	if len(body) < 9 {
		return responseFrame{}, fmt.Errorf("%w: response of %d bytes", errBadFrame, len(body))
	}
	r := responseFrame{id: binary.BigEndian.Uint64(body), status: body[8], payload: body[9:]}
	if r.status != statusOK && r.status != statusError {
		return responseFrame{}, fmt.Errorf("%w: response status %d", errBadFrame, r.status)
	}
	return r, nil
}

// responseOf builds the response to request id from a handler's outcome.
// A reply too large for a frame becomes an error, so the requester hears
// something instead of timing out.
func responseOf(id uint64, reply []byte, err error, limit int) responseFrame {
	if err == nil && len(reply) > limit-10 {
		err = fmt.Errorf("reply of %d bytes exceeds the frame limit", len(reply))
	}
	if err != nil {
		msg := err.Error()
		if len(msg) > 4096 {
			msg = msg[:4096]
		}
		return responseFrame{id: id, status: statusError, payload: []byte(msg)}
	}
	return responseFrame{id: id, status: statusOK, payload: reply}
}

func appendKnock(dst []byte, kind byte, payload []byte) []byte {
	dst = binary.BigEndian.AppendUint32(dst, uint32(2+len(payload)))
	dst = append(dst, frameKnock, kind)
	return append(dst, payload...)
}

// decodeKnock decodes a knock body; payload aliases body.
func decodeKnock(body []byte) (kind byte, payload []byte, err error) {
	if len(body) < 1 {
		return 0, nil, fmt.Errorf("%w: empty knock", errBadFrame)
	}
	return body[0], body[1:], nil
}
