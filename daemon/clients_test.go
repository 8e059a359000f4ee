package daemon

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// pahoPython returns a Python interpreter that has Debian's paho-mqtt
// (python3-paho-mqtt), or skips the test naming the package; under
// CI=true its absence fails the test (.ci/deps installs it). The
// system's interpreter is tried first: a python3 earlier on PATH (pyenv,
// a virtualenv) does not see Debian's modules.
func pahoPython(t *testing.T) string {
	t.Helper()
	for _, py := range []string{"/usr/bin/python3", "python3"} {
		if exec.Command(py, "-c", "import paho.mqtt.client").Run() == nil {
			return py
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("python3-paho-mqtt not installed: .ci/deps should have installed it")
	}
	t.Skip("python3-paho-mqtt not installed")
	return ""
}

// A client nobody here wrote, Eclipse paho-mqtt for Python, against one
// gateway: QoS 0/1/2 order over 3.1.1 and 5, retained messages, wills, a
// persistent session resumed (daemon/testdata/paho_clients.py says what
// each case checks). Then the gateway still answers and stops.
func TestPahoPython(t *testing.T) {
	py := pahoPython(t)
	d := testGateway(t, t.TempDir(), nil)
	host, port := splitAddr(t, d.MQTTAddr())
	for _, name := range []string{"qos_order", "retained", "will", "persistent_session"} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			out, err := exec.CommandContext(ctx, py, "testdata/paho_clients.py", name, host, port).CombinedOutput()
			if err != nil || strings.TrimSpace(string(out)) != "ok" {
				t.Fatalf("paho-mqtt %s: %v\n%s", name, err, out)
			}
		})
	}
	assertAnswersAndStops(t, d)
}

// MQTT.js 5 under Node, fetched with npm as for the browser test, runs the
// same cases as paho-mqtt (daemon/testdata/mqttjs_clients.js) against one
// gateway; then the gateway still answers and stops.
func TestMQTTJSNode(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("node not found: .ci/deps installs npm, which brings it")
		}
		t.Skip("node not found (apt-get install npm)")
	}
	modules := filepath.Dir(filepath.Dir(filepath.Dir(mqttJS(t)))) // …/node_modules
	d := testGateway(t, t.TempDir(), nil)
	for _, name := range []string{"qos_order", "retained", "will", "persistent_session"} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, node, "testdata/mqttjs_clients.js", name, "mqtt://"+d.MQTTAddr())
			cmd.Env = append(os.Environ(), "NODE_PATH="+modules)
			out, err := cmd.CombinedOutput()
			if err != nil || strings.TrimSpace(string(out)) != "ok" {
				t.Fatalf("MQTT.js %s: %v\n%s", name, err, out)
			}
		})
	}
	assertAnswersAndStops(t, d)
}
