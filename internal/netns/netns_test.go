package netns

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"
)

// The test binary re-runs itself inside a namespace as a UDP helper:
// NETNS_HELPER=listen prints every datagram it gets on :15353 (unicast and
// the group 224.0.0.251) as "got SRC PAYLOAD"; NETNS_HELPER=send sends
// NETNS_PAYLOAD to NETNS_TO.
func TestMain(m *testing.M) {
	switch os.Getenv("NETNS_HELPER") {
	case "listen":
		ifi, err := net.InterfaceByName(Iface)
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		c, err := net.ListenMulticastUDP("udp4", ifi, &net.UDPAddr{IP: net.IPv4(224, 0, 0, 251), Port: 15353})
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		fmt.Println("ready")
		buf := make([]byte, 1500)
		for {
			n, src, err := c.ReadFromUDP(buf)
			if err != nil {
				os.Exit(1)
			}
			fmt.Printf("got %s %s\n", src.IP, buf[:n])
		}
	case "send":
		c, err := net.Dial("udp4", os.Getenv("NETNS_TO"))
		if err == nil {
			_, err = c.Write([]byte(os.Getenv("NETNS_PAYLOAD")))
		}
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// lines collects a helper's stdout lines on a channel.
func lines(t *testing.T, h *Host) <-chan string {
	t.Helper()
	cmd := h.Command(self(t))
	cmd.Env = append(os.Environ(), "NETNS_HELPER=listen")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	h.Start(cmd)
	ch := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			ch <- sc.Text()
		}
		close(ch)
	}()
	return ch
}

// self is the test binary's path. Not /proc/self/exe: inside `ip netns
// exec` that names ip.
func self(t *testing.T) string {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

func send(h *Host, to, payload string) error {
	exe, _ := os.Executable()
	cmd := h.Command(exe)
	cmd.Env = append(os.Environ(), "NETNS_HELPER=send", "NETNS_TO="+to, "NETNS_PAYLOAD="+payload)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%v: %s", err, out)
	}
	return nil
}

// expect waits for the line want; any "got" line in forbid fails the test.
func expect(t *testing.T, ch <-chan string, want string, forbid ...string) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case l, ok := <-ch:
			if !ok {
				t.Fatalf("helper exited before %q", want)
			}
			if strings.HasPrefix(l, "error") {
				t.Fatalf("helper: %s", l)
			}
			for _, f := range forbid {
				if strings.Contains(l, f) {
					t.Fatalf("got %q, which should have been dropped", l)
				}
			}
			if l == want {
				return
			}
		case <-deadline:
			t.Fatalf("no %q within 5s", want)
		}
	}
}

func TestNetwork(t *testing.T) {
	Skip(t, "iptables")
	nt := New(t, 3)
	h1, h2, h3 := nt.Hosts[0], nt.Hosts[1], nt.Hosts[2]
	if h1.Addr() != "198.51.100.1" || h3.Addr() != "198.51.100.3" {
		t.Fatalf("addresses %s %s", h1.Addr(), h3.Addr())
	}
	ch := lines(t, h2)
	expect(t, ch, "ready")
	group := "224.0.0.251:15353"
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}

	must(send(h1, h2.Addr()+":15353", "unicast"))
	expect(t, ch, "got 198.51.100.1 unicast")
	must(send(h3, group, "multicast"))
	expect(t, ch, "got 198.51.100.3 multicast")

	// Cut h1–h2: h1's datagrams are dropped (its OUTPUT rule may refuse
	// the send itself); h3's marker still arrives, after anything h1 sent.
	nt.Cut(h1, h2)
	_ = send(h1, group, "cut")
	must(send(h3, group, "marker1"))
	expect(t, ch, "got 198.51.100.3 marker1", "cut")
	nt.Heal(h1, h2)
	must(send(h1, group, "healed"))
	expect(t, ch, "got 198.51.100.1 healed")

	// Partition h3 from the others, then heal all.
	nt.Partition([]*Host{h3}, []*Host{h1, h2})
	_ = send(h3, group, "partitioned")
	must(send(h1, group, "marker2"))
	expect(t, ch, "got 198.51.100.1 marker2", "partitioned")
	nt.HealAll()
	must(send(h3, group, "whole"))
	expect(t, ch, "got 198.51.100.3 whole")

	// Unplugged: h3's datagrams go nowhere.
	h3.Unplug()
	_ = send(h3, group, "unplugged")
	must(send(h1, group, "marker3"))
	expect(t, ch, "got 198.51.100.1 marker3", "unplugged")
	h3.Plug()

	// A new address is used at once, and multicast still has its route.
	h1.SetAddr("101")
	if h1.Addr() != "198.51.100.101" {
		t.Fatalf("addr after SetAddr: %s", h1.Addr())
	}
	must(send(h1, group, "moved"))
	expect(t, ch, "got 198.51.100.101 moved")
}

// Two networks at once get distinct names (parallel test packages rely on
// the pid and the counter).
func TestNamesUnique(t *testing.T) {
	a, b := New(t, 1), New(t, 1)
	if a.Switch == b.Switch || a.Hosts[0].NS == b.Hosts[0].NS {
		t.Fatalf("names collide: %s %s", a.Switch, b.Switch)
	}
	if !strings.Contains(a.Switch, fmt.Sprint(os.Getpid())) {
		t.Fatalf("name %s lacks the pid", a.Switch)
	}
}
