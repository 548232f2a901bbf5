// agent-mtp fleet dashboard: reads api/stats (relative to <base>) and draws it with the vendored uPlot.
// Read-only; no build step. User text (notes, run ids) is only ever set through textContent.
"use strict";

const CONFIG = JSON.parse(document.getElementById("dashboard-config").textContent);
const COLORS = ["#4c8bf5", "#e8710a", "#2e7d32", "#9c27b0", "#00838f", "#6d4c41"];
const asked = new URLSearchParams(window.location.search).get("window");
const state = { window: CONFIG.windows.includes(asked) ? asked : "5m", stepType: "all", view: null, charts: {} };

const pct = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%");
const num = (v, d = 2) => (v === null || v === undefined ? "-" : v.toFixed(d));
const times = (v) => (v === null || v === undefined ? "-" : v.toFixed(2) + "x");
const secs = (v) => {
  if (v === null || v === undefined) return "-";
  if (v < 1) return (v * 1000).toFixed(0) + " ms";
  return v < 10 ? v.toFixed(2) + " s" : v.toFixed(1) + " s";
};
const clock = (t) => new Date(t * 1000).toLocaleTimeString();

// One chart per quantity; every fleet is one line of its colour (the A/B view). Latency: P50 dashed, P99 dotted.
const CHARTS = [
  { id: "steps", title: "steps per point", metrics: ["requests"], fmt: (v) => num(v, 0) },
  { id: "timeout", title: "timeout ratio", metrics: ["timeout_ratio"], fmt: pct },
  { id: "retry", title: "retry rate", metrics: ["retry_rate"], fmt: pct },
  { id: "fallback", title: "fallback rate (to a safer mode)", metrics: ["fallback_rate"], fmt: pct },
  { id: "breaker", title: "steps under an open breaker", metrics: ["breaker_open_rate"], fmt: pct },
  { id: "error", title: "error rate", metrics: ["error_rate"], fmt: pct },
  { id: "monitor", title: "quality-monitor failure rate", metrics: ["monitor_failure_rate"], fmt: pct },
  { id: "latency", title: "latency P50 / P95 / P99", metrics: ["p50_s", "p95_s", "p99_s"], fmt: secs },
  { id: "ttft", title: "mean time to first token", metrics: ["mean_ttft_s"], fmt: secs },
  { id: "tpf", title: "tokens per forward pass", metrics: ["tokens_per_forward"], fmt: (v) => num(v) },
  { id: "speedup", title: "speedup vs NTP", metrics: ["speedup_vs_ntp"], fmt: times },
  { id: "cache", title: "prefix-cache hit rate (prompt tokens)", metrics: ["prefix_cache_hit_rate"], fmt: pct },
];
const DASH = { p50_s: [6, 4], p95_s: [], p99_s: [2, 3] };

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function fillTable(id, headers, rows) {
  const table = document.getElementById(id);
  const head = table.querySelector("thead");
  const body = table.querySelector("tbody");
  head.replaceChildren(el("tr"));
  for (const [label, cls] of headers) head.firstChild.appendChild(el("th", cls ? { class: cls } : {}, label));
  body.replaceChildren(...rows);
  table.style.display = rows.length ? "" : "none";
}

function row(cells, attrs = {}) {
  const tr = el("tr", attrs);
  for (const cell of cells) {
    const [text, cellAttrs] = Array.isArray(cell) ? cell : [cell, {}];
    tr.appendChild(el("td", cellAttrs, String(text)));
  }
  return tr;
}

const ratioCell = (field, ratio, count) => [`${pct(ratio)} (${count})`, { "data-field": field, "data-count": String(count) }];

function swatch(index) {
  const s = el("span", { class: "swatch" });
  s.style.background = COLORS[index % COLORS.length];
  return s;
}

function renderHeader() {
  const fleets = document.getElementById("fleets");
  fleets.replaceChildren(
    ...CONFIG.fleets.map((fleet, i) => {
      const span = el("span", { class: "fleet" });
      span.append(swatch(i), `${fleet.label} · namespace ${fleet.namespace} · ${fleet.target}`);
      return span;
    }),
  );
  const windows = document.getElementById("windows");
  windows.replaceChildren(
    ...CONFIG.windows.map((name) => {
      const button = el("button", { "data-window": name }, name);
      if (name === state.window) button.classList.add("active");
      button.onclick = () => {
        state.window = name;
        for (const b of windows.children) b.classList.toggle("active", b.dataset.window === name);
        refresh();
      };
      return button;
    }),
  );
  document.getElementById("step-type").onchange = (event) => {
    state.stepType = event.target.value;
    render();
  };
}

function renderSummary(fleets) {
  const cards = fleets.map((fleet, i) => {
    const card = el("div", { class: "card", "data-fleet": fleet.label });
    const title = el("h3");
    title.append(swatch(i), fleet.label);
    card.appendChild(title);
    if (fleet.error) {
      card.appendChild(el("div", { class: "error" }, fleet.error));
      return card;
    }
    const t = fleet.report.total;
    const items = [
      ["steps", t.requests, "requests"], ["timeout", pct(t.timeout_ratio)], ["retry", pct(t.retry_rate)],
      ["fallback", pct(t.fallback_rate)], ["error", pct(t.error_rate)], ["monitor fail", pct(t.monitor_failure_rate)],
      ["P50", secs(t.latency_s.p50)], ["P95", secs(t.latency_s.p95)], ["P99", secs(t.latency_s.p99)],
      ["tok/fwd", num(t.tokens_per_forward)], ["speedup", times(t.speedup_vs_ntp)], ["writers", fleet.report.writers, "writers"],
    ];
    const dl = el("dl");
    for (const [label, value, field] of items) {
      dl.appendChild(el("dt", {}, label));
      dl.appendChild(el("dd", field ? { "data-field": field } : {}, String(value)));
    }
    card.appendChild(dl);
    return card;
  });
  document.getElementById("summary").replaceChildren(...cards);
}

function chartData(spec, fleets) {
  const ok = fleets.filter((f) => !f.error);
  if (!ok.length) return null;
  const xs = ok[0].timeline.t;
  const series = [{}];
  const data = [xs];
  const plotted = {};
  fleets.forEach((fleet, i) => {
    if (fleet.error) return;
    const lines = fleet.timeline.series[state.stepType] || {};
    for (const metric of spec.metrics) {
      const values = lines[metric] || xs.map(() => null);
      const name = spec.metrics.length > 1 ? `${fleet.label} ${metric.replace("_s", "").toUpperCase()}` : fleet.label;
      series.push({
        label: name, stroke: COLORS[i % COLORS.length], width: 2, dash: DASH[metric] || [],
        points: { show: xs.length <= 60 }, value: (u, v) => spec.fmt(v),
      });
      data.push(values);
      plotted[name] = values;
    }
  });
  return { series, data, plotted };
}

// Every quantity here is >= 0: start the axis at 0 and keep a flat line (all 0 %) from a degenerate range.
function yRange(spec, lo, hi) {
  const floor = spec.fmt === pct ? 0.05 : 1;
  return [0, hi > 0 ? hi * 1.15 : floor];
}

function renderCharts(fleets) {
  const box = document.getElementById("charts");
  for (const spec of CHARTS) {
    const made = chartData(spec, fleets);
    let holder = document.getElementById("chart-" + spec.id);
    if (!holder) {
      holder = el("div", { class: "chart", id: "chart-" + spec.id });
      box.appendChild(holder);
    }
    if (!made) continue;
    holder.dataset.series = JSON.stringify(made.plotted);
    const key = made.series.map((s) => s.label || "").join("|");
    const existing = state.charts[spec.id];
    if (existing && existing.key === key) {
      existing.plot.setData(made.data);
      continue;
    }
    if (existing) existing.plot.destroy();
    const opts = {
      title: spec.title, width: Math.max(300, holder.clientWidth - 12), height: 210,
      scales: { x: { time: true }, y: { range: (u, lo, hi) => yRange(spec, lo, hi) } }, series: made.series,
      axes: [{}, { size: 64, values: (u, vals) => vals.map((v) => spec.fmt(v)) }],
    };
    state.charts[spec.id] = { key, plot: new uPlot(opts, made.data, holder) };
  }
}

function renderRows(fleets) {
  const headers = [
    ["fleet", "text"], ["step type", "text"], ["mode", "text"], ["steps"], ["timeout"], ["retry"], ["fallback"],
    ["breaker"], ["error"], ["monitor fail"], ["P50"], ["P95"], ["P99"], ["TTFT"], ["tok/fwd"], ["speedup"], ["cache hit"],
  ];
  const rows = [];
  for (const fleet of fleets) {
    if (fleet.error) continue;
    const chosen = fleet.report.rows.filter((r) => r.requests > 0 && (state.stepType === "all" || r.step_type === state.stepType));
    const total = state.stepType === "all" ? [{ ...fleet.report.total, step_type: "all", mode: "all", total: true }] : [];
    for (const r of [...chosen, ...total]) {
      rows.push(
        row(
          [
            [fleet.label, { class: "text" }], [r.step_type, { class: "text" }], [r.mode, { class: "text" }],
            [r.requests, { "data-field": "requests", "data-count": String(r.requests) }],
            ratioCell("timeouts", r.timeout_ratio, r.timeouts), ratioCell("retried", r.retry_rate, r.retried),
            ratioCell("fallbacks", r.fallback_rate, r.fallbacks), ratioCell("breaker_open", r.breaker_open_rate, r.breaker_open),
            ratioCell("errors", r.error_rate, r.errors), ratioCell("monitor_failed_steps", r.monitor_failure_rate, r.monitor_failed_steps),
            secs(r.latency_s.p50), secs(r.latency_s.p95), secs(r.latency_s.p99), secs(r.mean_ttft_s),
            num(r.tokens_per_forward), times(r.speedup_vs_ntp), pct(r.prefix_cache_hit_rate),
          ],
          { "data-fleet": fleet.label, "data-step-type": r.step_type, "data-mode": r.mode, class: r.total ? "total" : "" },
        ),
      );
    }
  }
  fillTable("rows", headers, rows);
}

function renderBreakersAndReplicas(fleets) {
  const breakers = [];
  const replicas = [];
  for (const fleet of fleets) {
    if (fleet.error) continue;
    for (const [stepType, b] of Object.entries(fleet.breakers)) {
      breakers.push(
        row(
          [
            [fleet.label, { class: "text" }], [stepType, { class: "text" }], [b.state, { class: b.state }],
            [b.breaker_open_steps, { "data-field": "breaker_open", "data-count": String(b.breaker_open_steps) }],
            pct(b.breaker_open_rate),
          ],
          { "data-fleet": fleet.label, "data-step-type": stepType },
        ),
      );
    }
    for (const r of fleet.replicas) {
      replicas.push(
        row([[fleet.label, { class: "text" }], [r.replica, { class: "text" }], r.buckets, clock(r.last_seen)], {
          "data-fleet": fleet.label,
        }),
      );
    }
  }
  fillTable("breakers", [["fleet", "text"], ["step type", "text"], ["state"], ["open-breaker steps"], ["share"]], breakers);
  fillTable("replicas", [["fleet", "text"], ["replica (host:pid)", "text"], ["active 10-s buckets"], ["last seen"]], replicas);
  document.getElementById("replica-count").textContent = `(${replicas.length})`;
}

function renderInterventions(fleets) {
  const counts = [];
  const recent = [];
  for (const fleet of fleets) {
    if (fleet.error) continue;
    const byStep = {};
    for (const r of fleet.report.rows) {
      if (!r.manual_interventions && !r.user_visible_failures) continue;
      const entry = (byStep[r.step_type] = byStep[r.step_type] || [0, 0]);
      entry[0] += r.manual_interventions;
      entry[1] += r.user_visible_failures;
    }
    for (const [stepType, [manual, failures]] of Object.entries(byStep)) {
      counts.push(
        row(
          [
            [fleet.label, { class: "text" }], [stepType, { class: "text" }],
            [manual, { "data-field": "manual_interventions", "data-count": String(manual) }],
            [failures, { "data-field": "user_visible_failures", "data-count": String(failures) }],
          ],
          { "data-fleet": fleet.label, "data-step-type": stepType },
        ),
      );
    }
    for (const n of fleet.report.recent_interventions.slice(0, 50)) {
      recent.push(
        row(
          [
            [fleet.label, { class: "text" }], [typeof n.timestamp === "number" ? clock(n.timestamp) : "?", { class: "text" }],
            [n.kind || "", { class: "text" }], [n.step_type || "", { class: "text" }], [n.run_id || "-", { class: "text" }],
            [n.note || "", { class: "note" }],
          ],
          { "data-fleet": fleet.label, class: "intervention" },
        ),
      );
    }
  }
  fillTable("intervention-counts", [["fleet", "text"], ["step type", "text"], ["manual"], ["user-visible failures"]], counts);
  fillTable(
    "interventions",
    [["fleet", "text"], ["time", "text"], ["kind", "text"], ["step type", "text"], ["run", "text"], ["note", "text"]],
    recent,
  );
}

function renderHealth(fleets) {
  const lines = fleets.map((fleet) => {
    if (fleet.error) return el("div", { class: "error" }, `${fleet.label}: ${fleet.error}`);
    const bad = Object.entries(fleet.report.health).filter(([, v]) => v);
    const text = bad.length
      ? `${fleet.label}: ${bad.map(([k, v]) => `${k}=${v}`).join(", ")}`
      : `${fleet.label}: nothing dropped, lost or rejected (percentiles are bucket upper edges, <= 10% high)`;
    return el("div", { class: bad.length ? "bad" : "good" }, text);
  });
  document.getElementById("health").replaceChildren(...lines);
}

function renderStepTypes(fleets) {
  const select = document.getElementById("step-type");
  const names = new Set(["all"]);
  for (const fleet of fleets) if (!fleet.error) for (const name of Object.keys(fleet.timeline.series)) names.add(name);
  const wanted = [...names];
  const have = [...select.options].map((o) => o.value);
  if (wanted.join("|") === have.join("|")) return;
  select.replaceChildren(...wanted.map((name) => el("option", { value: name }, name)));
  if (!names.has(state.stepType)) state.stepType = "all";
  select.value = state.stepType;
}

function render() {
  const view = state.view;
  if (!view) return;
  const fleets = view.fleets;
  renderStepTypes(fleets);
  renderSummary(fleets);
  renderCharts(fleets);
  renderRows(fleets);
  renderBreakersAndReplicas(fleets);
  renderInterventions(fleets);
  renderHealth(fleets);
  if (document.body.dataset.loaded !== "1") document.body.dataset.firstRenderMs = String(Math.round(performance.now()));
  document.body.dataset.loaded = "1";
  document.body.dataset.window = String(view.window_s);
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch(`api/stats?window=${encodeURIComponent(state.window)}`, { credentials: "same-origin" });
    const body = await response.json();
    if (!response.ok && !body.fleets) throw new Error(body.detail || response.statusText);
    state.view = body;
    render();
    status.textContent = `window ${state.window} · updated ${clock(body.generated_at)} · every ${CONFIG.refresh_s} s`;
    status.classList.remove("error");
  } catch (err) {
    status.textContent = `cannot load data: ${err.message}`;
    status.classList.add("error");
  }
}

renderHeader();
refresh();
setInterval(refresh, CONFIG.refresh_s * 1000);
