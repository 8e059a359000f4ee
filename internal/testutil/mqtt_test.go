package testutil

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

// TestMQTTFrameRoundTrip: the raw clients' framing agrees with itself at
// every width of the remaining length, and tells a clean end between
// packets from a cut inside one.
func TestMQTTFrameRoundTrip(t *testing.T) {
	for _, n := range []int{0, 1, 127, 128, 16383, 16384, 2097152} {
		body := bytes.Repeat([]byte{'x'}, n)
		r := bytes.NewReader(MQTTFrame(0x32, body))
		first, got, err := ReadMQTTFrame(r)
		if err != nil || first != 0x32 || !bytes.Equal(got, body) {
			t.Fatalf("%d-byte body: first %#x, %d bytes, %v", n, first, len(got), err)
		}
		if _, _, err := ReadMQTTFrame(r); err != io.EOF {
			t.Fatalf("after the only packet: %v, want io.EOF", err)
		}
	}
	if _, _, err := ReadMQTTFrame(bytes.NewReader([]byte{0x30})); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("cut after the first byte: %v, want io.ErrUnexpectedEOF", err)
	}
	if _, _, err := ReadMQTTFrame(bytes.NewReader([]byte{0x30, 0xff, 0xff, 0xff, 0xff, 1})); !errors.Is(err, ErrMalformedLength) {
		t.Errorf("five-byte remaining length: %v, want ErrMalformedLength", err)
	}
}
