"""Cases a third-party client runs against a gateway: Eclipse paho-mqtt
(Debian's python3-paho-mqtt, 1.6 or 2.x), as a device stack would use it.

Usage: paho_clients.py CASE HOST PORT. Prints "ok" and exits 0 when the
case holds; otherwise says what differed and exits 1. TestPahoPython
(daemon/clients_test.go) runs each case against an in-process gateway.
"""

import queue
import sys
import time

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.packettypes import PacketTypes

HOST, PORT = "127.0.0.1", 1883
WAIT = 20  # seconds any one step may take


def client(cid, protocol=mqtt.MQTTv311, clean=True):
    """A connected client, its network loop running; .got is a queue of
    the messages it receives."""
    kw = {"client_id": cid, "protocol": protocol}
    if protocol != mqtt.MQTTv5:
        kw["clean_session"] = clean
    if hasattr(mqtt, "CallbackAPIVersion"):  # paho-mqtt 2.x
        kw["callback_api_version"] = mqtt.CallbackAPIVersion.VERSION1
    c = mqtt.Client(**kw)
    c.got = queue.Queue()
    c.connack = queue.Queue()
    c.on_message = lambda cl, ud, m: c.got.put(m)
    if protocol == mqtt.MQTTv5:
        c.on_connect = lambda cl, ud, flags, rc, props=None: c.connack.put((flags, rc))
    else:
        c.on_connect = lambda cl, ud, flags, rc: c.connack.put((flags, rc))
    return c


def connect(c, protocol=mqtt.MQTTv311, clean=True, expiry=None):
    if protocol == mqtt.MQTTv5:
        props = None
        if expiry is not None:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = expiry
        c.connect(HOST, PORT, keepalive=30, clean_start=clean, properties=props)
    else:
        c.connect(HOST, PORT, keepalive=30)
    c.loop_start()
    flags, rc = c.connack.get(timeout=WAIT)
    if rc != 0:
        raise AssertionError("CONNACK %s" % rc)
    return flags


def subscribe(c, topic, qos):
    done = queue.Queue()
    c.on_subscribe = lambda *a: done.put(a)
    c.subscribe(topic, qos)
    done.get(timeout=WAIT)


def publish(c, topic, payload, qos, retain=False):
    info = c.publish(topic, payload, qos=qos, retain=retain)
    if qos > 0:
        info.wait_for_publish(timeout=WAIT)
        if not info.is_published():
            raise AssertionError("publish of %r to %s not acked" % (payload, topic))


def expect(c, n, what):
    out = []
    deadline = time.time() + WAIT
    while len(out) < n:
        try:
            out.append(c.got.get(timeout=max(0.1, deadline - time.time())))
        except queue.Empty:
            raise AssertionError("%s: got %d of %d messages: %r" % (what, len(out), n, [m.payload for m in out][:10]))
    return out


def quiet(c, what, wait=1.0):
    try:
        m = c.got.get(timeout=wait)
    except queue.Empty:
        return
    raise AssertionError("%s: unexpected message %s %r" % (what, m.topic, m.payload))


def stop(*cs):
    for c in cs:
        c.disconnect()
        c.loop_stop()


def case_qos_order():
    """QoS 0, 1 and 2, each 200 messages in a row: every one arrives,
    once, in order."""
    for proto in (mqtt.MQTTv311, mqtt.MQTTv5):
        for qos in (0, 1, 2):
            sub = client("py-sub-%d-%d" % (proto, qos), proto)
            connect(sub, proto)
            subscribe(sub, "py/order/%d" % qos, qos)
            pub = client("py-pub-%d-%d" % (proto, qos), proto)
            connect(pub, proto)
            n = 200
            for i in range(n):
                publish(pub, "py/order/%d" % qos, str(i), qos)
            got = [m.payload.decode() for m in expect(sub, n, "QoS %d v%d" % (qos, proto))]
            if got != [str(i) for i in range(n)]:
                raise AssertionError("QoS %d v%d out of order: %r" % (qos, proto, got[:20]))
            quiet(sub, "QoS %d v%d duplicates" % (qos, proto), 0.3)
            stop(sub, pub)


def case_retained():
    """A retained message goes to later subscribers with the retain flag;
    an empty retained message clears it."""
    pub = client("py-ret-pub")
    connect(pub)
    publish(pub, "py/ret/a", "kept", 1, retain=True)
    sub = client("py-ret-sub")
    connect(sub)
    subscribe(sub, "py/ret/#", 1)
    m = expect(sub, 1, "retained")[0]
    if m.payload != b"kept" or not m.retain:
        raise AssertionError("retained: got %r retain=%s" % (m.payload, m.retain))
    publish(pub, "py/ret/a", "", 1, retain=True)
    expect(sub, 1, "the clearing message")  # delivered live, not retained
    late = client("py-ret-late")
    connect(late)
    subscribe(late, "py/ret/#", 1)
    quiet(late, "after clearing")
    stop(pub, sub, late)


def case_will():
    """A client whose connection drops without DISCONNECT has its will
    published; one that disconnects cleanly does not."""
    sub = client("py-will-sub")
    connect(sub)
    subscribe(sub, "py/will/#", 1)
    for cid, clean_end in (("py-will-clean", True), ("py-will-dropped", False)):
        c = client(cid)
        c.will_set("py/will/" + cid, "gone", qos=1)
        connect(c)
        if clean_end:
            stop(c)
        else:
            c.loop_stop()
            c.socket().close()  # no DISCONNECT: the network failed
    m = expect(sub, 1, "the will")[0]
    if m.topic != "py/will/py-will-dropped" or m.payload != b"gone":
        raise AssertionError("will: got %s %r" % (m.topic, m.payload))
    quiet(sub, "the clean end's will")
    stop(sub)


def case_persistent_session():
    """A persistent session (3.1.1 clean session 0, MQTT 5 session expiry)
    comes back to the QoS 1 messages published while it was away, with
    session present, and keeps its subscription."""
    for proto in (mqtt.MQTTv311, mqtt.MQTTv5):
        cid = "py-persist-%d" % proto
        topic = "py/persist/%d" % proto
        c = client(cid, proto, clean=False)
        connect(c, proto, clean=True if proto == mqtt.MQTTv5 else False, expiry=300)
        subscribe(c, topic, 1)
        stop(c)
        pub = client("py-persist-pub-%d" % proto, proto)
        connect(pub, proto)
        for i in range(20):
            publish(pub, topic, "q%d" % i, 1)
        back = client(cid, proto, clean=False)
        flags = connect(back, proto, clean=False, expiry=300)
        if not flags.get("session present"):
            raise AssertionError("v%d: session present not set: %r" % (proto, flags))
        got = [m.payload.decode() for m in expect(back, 20, "v%d waiting messages" % proto)]
        if got != ["q%d" % i for i in range(20)]:
            raise AssertionError("v%d: waiting messages %r" % (proto, got))
        publish(pub, topic, "live", 1)
        if expect(back, 1, "v%d after the resume" % proto)[0].payload != b"live":
            raise AssertionError("v%d: the resumed subscription" % proto)
        stop(back, pub)
        # End the session so that a second run starts afresh.
        end = client(cid, proto, clean=True)
        connect(end, proto, clean=True, expiry=0)
        stop(end)


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in CASES:
        sys.exit("usage: paho_clients.py {%s} HOST PORT" % ",".join(sorted(CASES)))
    HOST, PORT = sys.argv[2], int(sys.argv[3])
    try:
        CASES[sys.argv[1]]()
    except (AssertionError, queue.Empty, OSError) as e:
        print("%s: %s: %s" % (sys.argv[1], type(e).__name__, e))
        sys.exit(1)
    print("ok")
