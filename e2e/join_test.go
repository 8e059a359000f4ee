package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
)

// `tandem cluster join` of the third gateway returns once it votes, so a
// cluster formed with join survives the master's kill -9 issued the moment
// join returns (before, join returned with the third still a learner: two
// voters, and the master's loss left no majority).
func TestThreeGatewaysFormedWithJoinSurviveAnImmediateMasterKill(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	g1, g2, g3 := startThree(t, nt)
	g2.join(g1)
	out, err := g1.cli("cluster", "invite")
	if err != nil {
		t.Fatal(err)
	}
	tok, _, _ := strings.Cut(out, "\n")
	said, err := g3.cli("cluster", "join", tok)
	if err != nil {
		t.Fatal(err)
	}
	g1.kill() // the moment join returns
	if !strings.Contains(said, "this gateway votes") {
		t.Errorf("join said %q; want that the gateway votes", said)
	}
	master := waitMaster(t, time.Now().Add(15*time.Second), g2, g3)
	c, err := device(t, master, "after-kill", nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
	defer cancel()
	if r, err := c.Publish(ctx, &paho.Publish{Topic: "s/after", QoS: 1, Payload: []byte("x")}); err != nil || r.ReasonCode != 0 {
		t.Fatalf("a sync publish on the new master %s: %v %+v", master.name, err, r)
	}
	g2.stop()
	g3.stop()
}
