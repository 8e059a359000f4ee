// Cases a third-party client runs against a gateway: MQTT.js 5 under
// Node, as a Node service or a dashboard's backend would use it.
//
// Usage: node mqttjs_clients.js CASE URL (NODE_PATH names the directory
// holding node_modules/mqtt). Prints "ok" and exits 0 when the case holds;
// otherwise says what differed and exits 1. TestMQTTJSNode
// (daemon/clients_test.go) runs each case against an in-process gateway.
"use strict";
const mqtt = require("mqtt");

const [, , name, url] = process.argv;
const WAIT = 20000;

function connect(clientId, opts = {}) {
  return new Promise((resolve, reject) => {
    const c = mqtt.connect(url, { clientId, reconnectPeriod: 0, connectTimeout: WAIT, ...opts });
    c.got = [];
    c.waiters = [];
    c.on("message", (topic, payload, packet) => {
      c.got.push({ topic, payload: payload.toString(), retain: packet.retain });
      c.waiters.forEach((w) => w());
    });
    c.once("connect", (ack) => { c.connack = ack; resolve(c); });
    c.once("error", reject);
  });
}

function messages(c, n, what) {
  return new Promise((resolve, reject) => {
    const done = () => { clearTimeout(t); c.waiters = c.waiters.filter((w) => w !== check); };
    const t = setTimeout(() => { done(); reject(new Error(`${what}: got ${c.got.length} of ${n}: ${JSON.stringify(c.got.slice(0, 10))}`)); }, WAIT);
    const check = () => {
      if (c.got.length >= n) {
        done();
        resolve(c.got.splice(0, n));
      }
    };
    c.waiters.push(check);
    check();
  });
}

async function quiet(c, what, ms = 1000) {
  await new Promise((r) => setTimeout(r, ms));
  if (c.got.length) throw new Error(`${what}: unexpected ${JSON.stringify(c.got)}`);
}

const end = (...cs) => Promise.all(cs.map((c) => c.endAsync()));

const cases = {
  // QoS 0, 1 and 2 over 3.1.1 and 5, 200 messages each: all, once, in order.
  async qos_order() {
    for (const protocolVersion of [4, 5]) {
      for (const qos of [0, 1, 2]) {
        const topic = `js/order/${protocolVersion}/${qos}`;
        const sub = await connect(`js-sub-${protocolVersion}-${qos}`, { protocolVersion });
        await sub.subscribeAsync(topic, { qos });
        const pub = await connect(`js-pub-${protocolVersion}-${qos}`, { protocolVersion });
        const n = 200;
        await Promise.all(Array.from({ length: n }, (_, i) => pub.publishAsync(topic, String(i), { qos })));
        const got = (await messages(sub, n, `QoS ${qos} v${protocolVersion}`)).map((m) => m.payload);
        if (got.join(",") !== Array.from({ length: n }, (_, i) => String(i)).join(","))
          throw new Error(`QoS ${qos} v${protocolVersion} out of order: ${got.slice(0, 20)}`);
        await quiet(sub, `QoS ${qos} v${protocolVersion} duplicates`, 300);
        await end(sub, pub);
      }
    }
  },
  // A retained message goes to later subscribers with the retain flag; an
  // empty one clears it.
  async retained() {
    const pub = await connect("js-ret-pub", { protocolVersion: 5 });
    await pub.publishAsync("js/ret/a", "kept", { qos: 1, retain: true });
    const sub = await connect("js-ret-sub", { protocolVersion: 5 });
    await sub.subscribeAsync("js/ret/#", { qos: 1 });
    const [m] = await messages(sub, 1, "retained");
    if (m.payload !== "kept" || !m.retain) throw new Error(`retained: ${JSON.stringify(m)}`);
    await pub.publishAsync("js/ret/a", "", { qos: 1, retain: true });
    await messages(sub, 1, "the clearing message");
    const late = await connect("js-ret-late", { protocolVersion: 5 });
    await late.subscribeAsync("js/ret/#", { qos: 1 });
    await quiet(late, "after clearing");
    await end(pub, sub, late);
  },
  // A client whose connection drops without DISCONNECT has its will
  // published; one that disconnects cleanly does not.
  async will() {
    const sub = await connect("js-will-sub", { protocolVersion: 5 });
    await sub.subscribeAsync("js/will/#", { qos: 1 });
    for (const [id, clean] of [["js-will-clean", true], ["js-will-dropped", false]]) {
      const c = await connect(id, { protocolVersion: 5, will: { topic: `js/will/${id}`, payload: "gone", qos: 1 } });
      if (clean) await c.endAsync();
      else c.stream.destroy(); // no DISCONNECT: the network failed
    }
    const [m] = await messages(sub, 1, "the will");
    if (m.topic !== "js/will/js-will-dropped" || m.payload !== "gone") throw new Error(`will: ${JSON.stringify(m)}`);
    await quiet(sub, "the clean end's will");
    await end(sub);
  },
  // A persistent session comes back to the QoS 1 messages published while
  // it was away, with session present, and keeps its subscription.
  async persistent_session() {
    for (const protocolVersion of [4, 5]) {
      const id = `js-persist-${protocolVersion}`, topic = `js/persist/${protocolVersion}`;
      const opts = protocolVersion === 5
        ? { protocolVersion, clean: false, properties: { sessionExpiryInterval: 300 } }
        : { protocolVersion, clean: false };
      const c = await connect(id, opts);
      await c.subscribeAsync(topic, { qos: 1 });
      await c.endAsync();
      const pub = await connect(`js-persist-pub-${protocolVersion}`, { protocolVersion });
      for (let i = 0; i < 20; i++) await pub.publishAsync(topic, `q${i}`, { qos: 1 });
      const back = await connect(id, opts);
      if (!back.connack.sessionPresent) throw new Error(`v${protocolVersion}: session present not set`);
      const got = (await messages(back, 20, `v${protocolVersion} waiting messages`)).map((m) => m.payload);
      if (got.join(",") !== Array.from({ length: 20 }, (_, i) => `q${i}`).join(","))
        throw new Error(`v${protocolVersion}: waiting messages ${got}`);
      await pub.publishAsync(topic, "live", { qos: 1 });
      const [live] = await messages(back, 1, `v${protocolVersion} after the resume`);
      if (live.payload !== "live") throw new Error(`v${protocolVersion}: the resumed subscription`);
      await end(back, pub);
      const gone = await connect(id, { protocolVersion, clean: true });
      await gone.endAsync();
    }
  },
};

if (!cases[name] || !url) {
  console.log(`usage: node mqttjs_clients.js {${Object.keys(cases).join(",")}} URL`);
  process.exit(2);
}
cases[name]().then(
  () => { console.log("ok"); process.exit(0); },
  (e) => { console.log(`${name}: ${e.message}`); process.exit(1); },
);
