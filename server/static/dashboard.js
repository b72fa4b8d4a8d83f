// The minillm dashboard: one EventSource, a few SVG line charts, and the traffic panel.
// No libraries and nothing fetched from elsewhere: the page works on a machine with no network.
"use strict";

const MAX_POINTS = 240; // two minutes at the server's two snapshots a second
const SVG = "http://www.w3.org/2000/svg";
const RETRY_MS = 5000; // the server's Retry-After for a page past its limit

const fixed = (digits) => (v) => (v === null || v === undefined ? "-" : v.toFixed(digits));
const percent = (v) => (v * 100).toFixed(0);

// What each chart plots: [label, how to read it from a snapshot] per line.
const CHARTS = [
  { id: "tokens", title: "Output tokens/s", unit: "tok/s", fmt: fixed(0), series: [["", (s) => s.tokens_per_s]] },
  { id: "requests", title: "Requests/s (finished)", unit: "req/s", fmt: fixed(1), series: [["", (s) => s.requests_per_s]] },
  { id: "queue", title: "Running and waiting requests", unit: "", fmt: fixed(0),
    series: [["running", (s) => s.running], ["waiting", (s) => s.waiting]] },
  { id: "batch", title: "Batch size (sequences per step)", unit: "seqs", fmt: fixed(0), series: [["", (s) => s.batch_size]] },
  { id: "kv", title: "KV cache usage", unit: "%", fmt: percent, series: [["", (s) => s.kv_cache_usage]] },
  { id: "ttft", title: "Time to first token, last 30 s", unit: "ms", fmt: fixed(1),
    series: [["p50", (s) => s.ttft_ms.p50], ["p95", (s) => s.ttft_ms.p95], ["p99", (s) => s.ttft_ms.p99]] },
  { id: "itl", title: "Inter-token latency, last 30 s", unit: "ms", fmt: fixed(1),
    series: [["p50", (s) => s.itl_ms.p50], ["p95", (s) => s.itl_ms.p95], ["p99", (s) => s.itl_ms.p99]] },
  { id: "preemptions", title: "Preemptions (total)", unit: "", fmt: fixed(0), series: [["", (s) => s.preemptions]] },
];

function element(tag, attributes = {}, text = "") {
  const node = tag === "svg" || tag === "path" ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

// Build one chart's card; its points live on the object, its DOM in the page.
function makeChart(spec) {
  const card = element("div", { class: spec.series.length > 1 ? "card multi" : "card", id: spec.id });
  card.append(element("h2", {}, spec.title));
  const value = element("p", { class: "value" }, "-");
  card.append(value);
  const svg = element("svg", { viewBox: `0 0 ${MAX_POINTS - 1} 100`, preserveAspectRatio: "none", "data-points": "0" });
  const paths = spec.series.map((_, i) => svg.appendChild(element("path", { class: `s${i}` })));
  card.append(svg);
  const scale = element("div", { class: "scale" });
  card.append(scale);
  if (spec.series.length > 1) {
    const legend = element("div", { class: "legend" });
    spec.series.forEach(([label], i) => legend.append(element("span", { class: `s${i}` }, label)));
    card.append(legend);
  }
  document.getElementById("charts").append(card);
  return { spec, value, svg, paths, scale, points: spec.series.map(() => []) };
}

function push(chart, snapshot) {
  chart.spec.series.forEach(([, read], i) => {
    const line = chart.points[i];
    line.push(read(snapshot));
    if (line.length > MAX_POINTS) line.shift();
  });
  const latest = chart.spec.series.map(([label, read]) => [label, chart.spec.fmt(read(snapshot))]);
  chart.value.textContent = latest.map(([label, v]) => (label ? `${label} ${v}` : v)).join("  ");
  chart.value.append(element("small", {}, ` ${chart.spec.unit}`));
  chart.value.dataset.value = String(chart.spec.series[0][1](snapshot) ?? "");
}

// A path per series, scaled so the largest value in view sits near the top; null is a gap.
function draw(chart) {
  const values = chart.points.flat().filter((v) => v !== null && v !== undefined);
  const top = Math.max(...values, 1e-9) * 1.1;
  chart.paths.forEach((path, i) => {
    const line = chart.points[i];
    const offset = MAX_POINTS - line.length;
    let d = "";
    let pen = "M";
    line.forEach((v, x) => {
      if (v === null || v === undefined) { pen = "M"; return; }
      d += `${pen}${offset + x} ${(100 - (v / top) * 100).toFixed(2)} `;
      pen = "L";
    });
    path.setAttribute("d", d.trim());
  });
  chart.svg.dataset.points = String(chart.points[0].length);
  chart.scale.textContent = values.length ? `max ${chart.spec.fmt(Math.max(...values))} ${chart.spec.unit}` : "";
}

function showTraffic(t) {
  const status = document.getElementById("traffic-status");
  status.className = t.state === "failed" ? "error" : "";
  // One run at a time: the server answers a start during a run with 409, so offer only Stop.
  document.getElementById("start").disabled = t.state === "running";
  if (t.state === "idle") {
    status.textContent = "idle";
    return;
  }
  const counts = `${t.sent} sent, ${t.completed} completed, ${t.failed} failed`;
  if (t.state === "running") {
    status.textContent = `running at ${t.request_rate} req/s: ${counts}, ${t.in_flight} in flight, ` +
      `${t.seconds_left.toFixed(0)} s left`;
  } else if (t.state === "failed") {
    status.textContent = `failed: ${t.error}`;
  } else {
    status.textContent = `finished: ${counts}; ${fixed(0)(t.output_throughput)} tok/s, ` +
      `p99 TTFT ${fixed(1)(t.ttft_p99_ms)} ms (client clock)`;
  }
}

const charts = CHARTS.map(makeChart);
let pending = false;

function connect() {
  const connection = document.getElementById("connection");
  const source = new EventSource("/dashboard/events");
  source.onopen = () => { connection.textContent = "live"; connection.className = "live"; };
  source.onerror = () => {
    connection.textContent = "reconnecting";
    connection.className = "down";
    // EventSource retries a dropped connection by itself, but not an error status (a 503 when
    // too many pages are watching): then it is closed, and the page tries again itself.
    if (source.readyState === EventSource.CLOSED) setTimeout(connect, RETRY_MS);
  };
  source.onmessage = (event) => {
    const snapshot = JSON.parse(event.data);
    charts.forEach((chart) => push(chart, snapshot));
    showTraffic(snapshot.traffic);
    if (!pending) {
      pending = true; // redraw once per frame however many snapshots arrived
      requestAnimationFrame(() => { pending = false; charts.forEach(draw); });
    }
  };
}

async function traffic(method, body) {
  const status = document.getElementById("traffic-status");
  const response = await fetch("/dashboard/traffic", {
    method, headers: { "Content-Type": "application/json" }, body: body && JSON.stringify(body),
  });
  const answer = await response.json();
  if (response.ok) {
    showTraffic(answer);
  } else {
    status.textContent = answer.error.message;
    status.className = "error";
  }
}

document.getElementById("traffic-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const form = new FormData(event.target);
  const body = {};
  for (const [name, value] of form.entries()) body[name] = Number(value);
  traffic("POST", body);
});
document.getElementById("stop").addEventListener("click", () => traffic("DELETE"));
connect();
