package testutil

import (
	"encoding/binary"
	"errors"
	"io"
)

// MQTTFrame prefixes body with MQTT's fixed header: first (type and
// flags) and the remaining length as a variable-length integer. Raw
// clients in tests build with it the packets a library would not send.
func MQTTFrame(first byte, body []byte) []byte {
	// MQTT's variable byte integer is the base-128 varint Go calls Uvarint.
	b := binary.AppendUvarint([]byte{first}, uint64(len(body)))
	return append(b, body...)
}

// ErrMalformedLength is ReadMQTTFrame's error for a remaining length longer
// than MQTT's four bytes.
var ErrMalformedLength = errors.New("malformed remaining length")

// ReadMQTTFrame reads one MQTT packet from r: its first byte (type and
// flags) and its body. Errors are r's, io.EOF only for an end between two
// packets (io.ErrUnexpectedEOF within one), or ErrMalformedLength.
func ReadMQTTFrame(r io.Reader) (first byte, body []byte, err error) {
	var b [1]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return 0, nil, err
	}
	first = b[0]
	n, mul := 0, 1
	for i := 0; ; i++ {
		if _, err := io.ReadFull(r, b[:]); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return 0, nil, err
		}
		n += int(b[0]&0x7f) * mul
		mul *= 128
		if b[0]&0x80 == 0 {
			break
		}
		if i == 3 {
			return 0, nil, ErrMalformedLength
		}
	}
	body = make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return 0, nil, err
	}
	return first, body, nil
}
