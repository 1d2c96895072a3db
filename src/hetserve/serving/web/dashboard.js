// The dashboard view: polled from /v1/dashboard every second while it is shown; a card per worker,
// the recent routing decisions, the latency percentiles and their chart.
import { $, clock, el, fmt, ms, pct } from "./dom.js";
import { api, AuthError, errorMessage } from "./api.js";
import { drawChart } from "./chart.js";

// ---------------------------------------------------------------- polling
let visible = false; // the dashboard tab is the one shown: it polls only then
let pollTimer = null;
let polling = false;
// The last payload (window.hetserve.dashboard, for tests and debugging).
export let lastDash = null;

function stopPolling() {
  clearTimeout(pollTimer);
  pollTimer = null;
}

function pollNow() {
  stopPolling();
  if (!polling) poll();
}

// The tab is shown: poll now, then every second; hidden: stop.
export function showDashboard() {
  visible = true;
  pollNow();
}

export function hideDashboard() {
  visible = false;
  stopPolling();
}

// A key was entered: poll now if the dashboard is shown (a 401 stopped its polling).
export function refreshDashboard() {
  if (visible) pollNow();
}

async function poll() {
  polling = true;
  let again = true;
  try {
    const resp = await api("/v1/dashboard");
    if (!resp.ok) throw new Error(await errorMessage(resp));
    const d = await resp.json();
    lastDash = d;
    renderDashboard(d);
  } catch (e) {
    if (e instanceof AuthError) {
      again = false; // until a key is entered
      $("dash-meta").textContent = "Not authorized: enter the API key.";
    } else {
      $("dash-meta").textContent = "Dashboard unavailable: " + (e.message || e) + " (retrying)";
    }
    $("dash-meta").classList.add("bad");
  } finally {
    polling = false;
    if (again && visible) {
      clearTimeout(pollTimer);
      pollTimer = setTimeout(poll, 1000);
    }
  }
}

// ---------------------------------------------------------------- workers
const workerCards = new Map();

function metric(label, valueNode, testid) {
  return el("div", { class: "metric" }, el("dt", {}, label), el("dd", { "data-field": testid }, valueNode));
}

function makeWorkerCard(name) {
  const card = el("article", { class: "worker", "data-testid": "worker-card", "data-worker": name,
    "aria-label": "worker " + name });
  const head = el("header", { class: "worker-head" },
    el("h3", { class: "worker-name" }, name),
    el("span", { class: "device", "data-field": "device" }),
    el("span", { class: "state", "data-testid": "worker-state", "data-field": "state" }));
  const reason = el("p", { class: "reason", "data-testid": "worker-reason", hidden: true });
  const bar = el("div", { class: "bar", role: "progressbar", "aria-label": "KV pages used", "aria-valuemin": "0" },
    el("span", { class: "fill" }));
  const kv = el("div", { class: "kv" }, el("div", { class: "kv-label" }, "KV pages ",
    el("span", { "data-field": "kv" })), bar);
  const dl = el("dl", { class: "metrics" },
    metric("running", "", "running"), metric("waiting", "", "waiting"),
    metric("decode tok/s", "", "decode"), metric("prefill tok/s", "", "prefill"),
    metric("prefix hit rate", "", "hit"), metric("preemptions", "", "preemptions"),
    metric("spec acceptance", "", "spec-acc"), metric("spec mean K", "", "spec-k"));
  const profile = el("details", { class: "profile" }, el("summary", {}, "Profile"),
    el("div", { class: "profile-body", "data-field": "profile" }));
  card.append(head, reason, kv, dl, profile);
  return card;
}

function setField(card, field, text) {
  const n = card.querySelector('[data-field="' + field + '"]');
  if (n.textContent !== text) n.textContent = text;
}

// The start-up (or given) rates beside the ones the router prices the worker at now.
function profileTable(title, rows, now, xLabel) {
  const current = new Map((now || []).map(([x, v]) => [x, v]));
  return el("table", { class: "mini" }, el("caption", {}, title + " tok/s"),
    el("thead", {}, el("tr", {}, el("th", { scope: "col" }, xLabel), el("th", { scope: "col" }, "start-up"),
      el("th", { scope: "col" }, "now"))),
    el("tbody", {}, ...(rows || []).map(([x, v]) => el("tr", {}, el("td", {}, fmt(x)), el("td", {}, fmt(v, 0)),
      el("td", {}, current.has(x) ? fmt(current.get(x), 0) : "–")))));
}

function renderWorker(card, w) {
  setField(card, "device", w.device || "");
  const state = w.state || "unknown";
  setField(card, "state", state);
  card.dataset.state = state;
  card.querySelector(".state").className = "state state-" + state;
  const reason = card.querySelector(".reason");
  const why = w.reason || "no reason given";
  const rtext = state === "dead" ? "dead: " + why
    : state === "restarting" ? "restarting: " + why + " (restarts so far: " + (w.restarts || 0) + ")" : "";
  reason.hidden = !rtext;
  if (reason.textContent !== rtext) reason.textContent = rtext;
  setField(card, "running", fmt(w.running));
  setField(card, "waiting", fmt(w.waiting));
  const used = w.kv_pages_used || 0;
  const total = w.kv_pages_total || 0;
  setField(card, "kv", fmt(used) + " / " + fmt(total));
  const bar = card.querySelector(".bar");
  bar.setAttribute("aria-valuemax", String(total));
  bar.setAttribute("aria-valuenow", String(used));
  const frac = total ? Math.min(1, used / total) : 0;
  bar.querySelector(".fill").style.width = (100 * frac).toFixed(1) + "%";
  bar.classList.toggle("high", frac > 0.85);
  setField(card, "decode", fmt(w.decode_tok_s, 1));
  setField(card, "prefill", fmt(w.prefill_tok_s, 1));
  setField(card, "hit", w.prefix_cache ? pct(w.prefix_cache.hit_rate) : "–");
  setField(card, "preemptions", fmt(w.preemptions));
  setField(card, "spec-acc", w.spec ? pct(w.spec.acceptance_rate) : "off");
  setField(card, "spec-k", w.spec ? fmt(w.spec.mean_k, 2) : "–");
  const sig = JSON.stringify(w.profile || null);
  const body = card.querySelector('[data-field="profile"]');
  if (body.dataset.sig !== sig) {
    body.dataset.sig = sig;
    const p = w.profile;
    const now = (p && p.current) || {};
    const spread = p && p.spread ? ", rounds within " + pct(p.spread.worst) : "";
    if (!p) body.replaceChildren(el("p", { class: "hint" }, "No profile."));
    else body.replaceChildren(
      el("p", { class: "hint" }, "Measured on " + (p.device || w.device || "?") + spread +
        "; now from " + fmt((now.speed || {}).steps || 0) + " steps"),
      el("div", { class: "mini-tables" },
        profileTable("Prefill", p.prefill, now.prefill, "tokens"),
        profileTable("Decode", p.decode, now.decode, "batch")));
  }
}

function renderDashboard(d) {
  const meta = $("dash-meta");
  meta.classList.remove("bad");
  const up = (d.workers || []).filter((w) => w.state === "up").length;
  meta.textContent = (d.model || "") + " · route policy " + (d.route_policy || "?") + " · " + up + "/" +
    (d.workers || []).length + " workers up · " + (d.time ? clock(d.time) : "");

  const box = $("workers");
  const seen = new Set();
  for (const w of d.workers || []) {
    seen.add(w.name);
    let card = workerCards.get(w.name);
    if (!card) {
      card = makeWorkerCard(w.name);
      workerCards.set(w.name, card);
      box.append(card);
    }
    renderWorker(card, w);
  }
  for (const [name, card] of workerCards) {
    if (!seen.has(name)) {
      card.remove();
      workerCards.delete(name);
    }
  }
  renderRoutes(d.routes || []);
  renderLatency(d.latency || null);
}

// ---------------------------------------------------------------- routing decisions
function cell(v) {
  if (typeof v === "number") return fmt(v);
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (v === null || v === undefined) return "–";
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

let routesSig = "";

function renderRoutes(routes) {
  const sig = routes.map((r) => r.request_id + ":" + r.time).join(",");
  $("routes-empty").hidden = routes.length > 0;
  if (sig === routesSig) return;
  routesSig = sig;
  const list = $("routes");
  list.replaceChildren(...routes.map(routeNode));
}

// "prefill cpu0 → decode cpu1" then every other field, generically.
function pairs(obj, skip) {
  return Object.entries(obj).filter(([k, v]) => !skip.includes(k) && v !== null && v !== undefined)
    .map(([k, v]) => el("span", { class: "kvpair" }, k.replace(/_/g, " ") + " " + cell(v)));
}

function routeNode(r) {
  if (r.event || !r.candidates) return eventNode(r);
  const cands = r.candidates;
  const decode = r.split ? r.split.decode : null;
  // Every field any candidate has, except its name: rendered generically.
  const fields = [];
  for (const c of cands) for (const k of Object.keys(c)) if (k !== "worker" && !fields.includes(k)) fields.push(k);
  const table = el("table", { class: "cands", "data-testid": "route-candidates" },
    el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "worker"),
      ...fields.map((f) => el("th", { scope: "col" }, f.replace(/_/g, " "))))),
    el("tbody", {}, ...cands.map((c) => {
      const chosen = c.worker === r.choice;
      const mark = chosen ? (decode ? " ✓ chosen (prefill)" : " ✓ chosen") : c.worker === decode ? " decode" : null;
      return el("tr", { class: chosen ? "chosen" : c.worker === decode ? "decode" : null, "data-worker": c.worker,
        "data-chosen": chosen ? "true" : null },
      el("th", { scope: "row" }, c.worker, mark ? el("span", { class: "chosen-mark" }, mark) : null),
      ...fields.map((f) => el("td", {}, cell(c[f]))));
    })));
  const head = el("div", { class: "route-head" },
    el("span", { class: "route-time" }, r.time ? clock(r.time) : ""),
    el("span", { class: "route-choice" }, "→ ", el("strong", { "data-testid": "route-choice" }, r.choice || "?"),
      decode ? " → " + decode : ""),
    el("span", { class: "route-meta" },
      (r.policy || "") + " · " + cell(r.prompt_tokens) + " prompt tok · max " + cell(r.max_tokens)));
  const item = el("li", { class: "route", "data-testid": "route", "data-request-id": r.request_id || "" }, head,
    el("div", { class: "route-id", title: r.request_id || "" }, r.request_id || ""),
    el("div", { class: "table-wrap" }, table));
  if (r.split) {
    item.append(el("p", { class: "split", "data-testid": "route-split" },
      el("strong", {}, "split: prefill " + cell(r.split.prefill) + " → decode " + cell(r.split.decode) + " "),
      ...pairs(r.split, ["prefill", "decode"])));
  }
  return item;
}

// Other entries of the list (a KV transfer of a split request): their fields as they are.
function eventNode(r) {
  const failed = r.ok === false;
  const what = r.event === "kv_transfer" ? "KV transfer" : r.event || "event";
  const route = r.prefill !== undefined && r.decode !== undefined ? " " + cell(r.prefill) + " → " + cell(r.decode) : "";
  return el("li", { class: failed ? "route event failed" : "route event", "data-testid": "route-event",
    "data-request-id": r.request_id || "" },
  el("div", { class: "route-head" },
    el("span", { class: "route-time" }, r.time ? clock(r.time) : ""),
    el("strong", {}, what + route), failed ? el("span", { class: "bad-text" }, "failed") : null),
  el("div", { class: "route-id", title: r.request_id || "" }, r.request_id || ""),
  el("p", { class: "split" }, ...pairs(r, ["time", "request_id", "event", "prefill", "decode", "ok"])));
}

// ---------------------------------------------------------------- latency
function renderLatency(lat) {
  const sum = $("latency-summary");
  if (!lat) {
    sum.replaceChildren(el("p", { class: "hint" }, "No latency data."));
    drawChart([]);
    return;
  }
  $("latency-window").textContent = lat.window_s ? "(last " + Math.round(lat.window_s / 60) + " min)" : "";
  const row = (name, q) => el("div", { class: "lat" }, el("dt", {}, name),
    el("dd", {}, q && q.p50 !== null && q.p50 !== undefined
      ? "p50 " + ms(q.p50) + " · p90 " + ms(q.p90) + " · p99 " + ms(q.p99) : "no samples yet"));
  sum.replaceChildren(row("TTFT", lat.ttft), row("ITL", lat.itl));
  drawChart(lat.series || []);
}

// Redraw the chart to the canvas's new width.
export function initDashboard() {
  window.addEventListener("resize", () => {
    if (lastDash && visible) drawChart((lastDash.latency && lastDash.latency.series) || []);
  });
}
