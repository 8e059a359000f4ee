package daemon

import (
	"path/filepath"
	"testing"

	"github.com/tandem-edge/tandem/config"
)

// A client id belongs to the user whose session holds it: another user (or
// an anonymous client) presenting it would inherit that session's
// subscriptions and in-flight messages, and kick its owner off.
func TestClientIDOfAnotherUsersSessionRefused(t *testing.T) {
	d, _ := startGateway(t, func(c *config.Config) {
		c.MQTT.AllowAnonymous = true
		c.MQTT.UsersFile = usersFile(t, filepath.Join(t.TempDir(), "users"), "alice", "pw-a", "bob", "pw-b")
	})
	alice := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "alice-dev", user: ptr("alice"), pass: ptr("pw-a")})
	for _, o := range []connOpts{
		{version: 5, id: "alice-dev"},
		{version: 4, id: "alice-dev", user: ptr("bob"), pass: ptr("pw-b")},
	} {
		c, ca := dialMQTTOpts(t, d.MQTTAddr(), o)
		if !ca.closed && ca.code == 0 {
			t.Fatalf("%v took over alice's client id: %+v", o.user, ca)
		}
		c.Close()
	}
	// alice's own connection is untouched and her reconnect is allowed.
	if got := alice.ping(); len(got) != 1 || got[0] != 0xd0 {
		t.Fatalf("alice's connection after the attempts: %x", got)
	}
	mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "alice-dev", user: ptr("alice"), pass: ptr("pw-a")})
}
