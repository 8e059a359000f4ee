package replication

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/tandem-edge/tandem/storage"
)

// The forward stream's wire format: the payload of a forward request and of
// its answer, carried by the transport's Request (integers big-endian):
//
//	batch   version u8 (2) | epoch u64 | seq u64 | count uvarint |
//	        count × (mode u8 | size uvarint | record)
//	answer  version u8 (2) | count uvarint | count × (code u8 [| size uvarint | text])
//
// The answer holds one outcome per record of the batch, in its order; the
// text follows the codes that carry one (fwdStorage, fwdOther). Errors cross
// as codes because the slave must tell them apart (a "not the master" is
// sent again, a timeout is the device's refusal). The version starts at 2:
// the one-record request before it began with the ack mode, 0 or 1, so a
// gateway of that release is refused with a clear error, never misread.
const fwdVersion = 2

// Outcomes of a forwarded record, as answer codes.
const (
	fwdOK byte = iota
	fwdNotLeader
	fwdAckTimeout
	fwdStorage
	fwdOther
)

// errBadForward reports a forward batch or answer that does not parse.
var errBadForward = errors.New("replication: malformed forward batch")

// fwdRecord is one record of a decoded batch.
type fwdRecord struct {
	id   recID
	mode AckMode
	data []byte
}

// encodeForward encodes one batch of the stream.
func encodeForward(epoch, seq uint64, recs []*proposal) []byte {
	size := 1 + 8 + 8 + binary.MaxVarintLen64
	for _, p := range recs {
		size += 1 + binary.MaxVarintLen64 + len(p.data)
	}
	b := make([]byte, 0, size)
	b = append(b, fwdVersion)
	b = binary.BigEndian.AppendUint64(b, epoch)
	b = binary.BigEndian.AppendUint64(b, seq)
	b = binary.AppendUvarint(b, uint64(len(recs)))
	for _, p := range recs {
		b = append(b, byte(p.mode))
		b = binary.AppendUvarint(b, uint64(len(p.data)))
		b = append(b, p.data...)
	}
	return b
}

// decodeForward decodes a batch; the records' data alias b.
func decodeForward(b []byte) (epoch, seq uint64, recs []fwdRecord, err error) {
	if len(b) < 17 || b[0] != fwdVersion {
		return 0, 0, nil, fmt.Errorf("%w: header", errBadForward)
	}
	epoch, seq = binary.BigEndian.Uint64(b[1:]), binary.BigEndian.Uint64(b[9:])
	b = b[17:]
	count, k := binary.Uvarint(b)
	if k <= 0 || count > uint64(len(b)) { // every record takes at least a byte
		return 0, 0, nil, fmt.Errorf("%w: count", errBadForward)
	}
	b = b[k:]
	recs = make([]fwdRecord, 0, count)
	for i := uint64(0); i < count; i++ {
		if len(b) < 1 || b[0] > byte(Sync) {
			return 0, 0, nil, fmt.Errorf("%w: mode of record %d", errBadForward, i)
		}
		mode := AckMode(b[0])
		size, k := binary.Uvarint(b[1:])
		if k <= 0 || size > uint64(len(b)-1-k) {
			return 0, 0, nil, fmt.Errorf("%w: size of record %d", errBadForward, i)
		}
		data := b[1+k : 1+k+int(size)]
		b = b[1+k+int(size):]
		origin, s, err := storage.RecordID(data)
		if err != nil {
			return 0, 0, nil, fmt.Errorf("%w: record %d: %v", errBadForward, i, err)
		}
		recs = append(recs, fwdRecord{id: recID{origin, s}, mode: mode, data: data})
	}
	if len(b) != 0 {
		return 0, 0, nil, fmt.Errorf("%w: %d bytes after the records", errBadForward, len(b))
	}
	return epoch, seq, recs, nil
}

// encodeForwardAnswer encodes the outcome of each record of a batch.
func encodeForwardAnswer(outcomes []error) []byte {
	b := make([]byte, 0, 1+binary.MaxVarintLen64+len(outcomes))
	b = append(b, fwdVersion)
	b = binary.AppendUvarint(b, uint64(len(outcomes)))
	for _, err := range outcomes {
		code := fwdOther
		switch {
		case err == nil:
			code = fwdOK
		case errors.Is(err, ErrNotLeader), errors.Is(err, ErrStopped):
			code = fwdNotLeader
		case errors.Is(err, ErrAckTimeout):
			code = fwdAckTimeout
		case errors.Is(err, ErrStorage):
			code = fwdStorage
		}
		b = append(b, code)
		if code == fwdStorage || code == fwdOther {
			b = binary.AppendUvarint(b, uint64(len(err.Error())))
			b = append(b, err.Error()...)
		}
	}
	return b
}

// decodeForwardAnswer decodes the answer to a batch of want records into
// the error each outcome stands for (nil: acked).
func decodeForwardAnswer(b []byte, want int) ([]error, error) {
	if len(b) < 1 || b[0] != fwdVersion {
		return nil, fmt.Errorf("%w: answer header", errBadForward)
	}
	count, k := binary.Uvarint(b[1:])
	if k <= 0 || count != uint64(want) {
		return nil, fmt.Errorf("%w: %d answers for %d records", errBadForward, count, want)
	}
	b = b[1+k:]
	out := make([]error, want)
	for i := range out {
		if len(b) < 1 {
			return nil, fmt.Errorf("%w: answer %d missing", errBadForward, i)
		}
		code := b[0]
		b = b[1:]
		var text string
		if code == fwdStorage || code == fwdOther {
			size, k := binary.Uvarint(b)
			if k <= 0 || size > uint64(len(b)-k) {
				return nil, fmt.Errorf("%w: text of answer %d", errBadForward, i)
			}
			text = string(b[k : k+int(size)])
			b = b[k+int(size):]
		}
		switch code {
		case fwdOK:
		case fwdNotLeader:
			out[i] = ErrNotLeader
		case fwdAckTimeout:
			out[i] = ErrAckTimeout
		case fwdStorage:
			out[i] = fmt.Errorf("%w: on the master: %s", ErrStorage, text)
		case fwdOther:
			out[i] = fmt.Errorf("master: %s", text)
		default:
			return nil, fmt.Errorf("%w: answer code %d", errBadForward, code)
		}
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the answers", errBadForward, len(b))
	}
	return out, nil
}
