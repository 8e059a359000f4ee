package replication

import (
	"testing"
	"time"
)

// A master cut off from both other voters knows it about an election
// timeout after the cut (CutOff), sooner than check-quorum's step-down,
// and says so until it hears a majority again; the others never do.
func TestCutOffMasterKnowsItAfterAnElectionTimeout(t *testing.T) {
	c := newCluster(t, 3)
	lead := c.leader()
	if !lead.CutOff().IsZero() {
		t.Fatal("a master with its voters in reach says it is cut off")
	}
	cut := time.Now()
	c.net.isolate(lead.ID())
	waitFor(t, "the master to find itself cut off", func() bool { return !lead.CutOff().IsZero() })
	// Time is counted in ticks: the last message heard may be up to a
	// tick older than the cut.
	if took, least := lead.CutOff().Sub(cut), lead.cfg.ElectionTimeout-2*lead.cfg.Heartbeat; took < least {
		t.Fatalf("cut off after %v, less than an election timeout (%v) without a majority", took, lead.cfg.ElectionTimeout)
	}
	other := c.masterOtherThan(lead.ID())
	if !other.CutOff().IsZero() {
		t.Fatal("the majority's master says it is cut off")
	}
	if lead.CutOff().IsZero() {
		t.Fatal("the cut-off member forgot it is cut off once it stepped down")
	}
	c.net.heal()
	waitFor(t, "the healed member to hear a majority again", func() bool { return lead.CutOff().IsZero() })
}
