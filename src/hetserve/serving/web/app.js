// hetserve's web page: a streaming chat and a live view of the workers and the router.
// Plain JS, no framework, no external URL. Model output is only ever put in the page through
// textContent / text nodes, never innerHTML.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "hetserve.apiKey";
  const CONV_STORE = "hetserve.conversations";
  const CURRENT_STORE = "hetserve.current";
  const SETTINGS_STORE = "hetserve.settings";

  // ---------------------------------------------------------------- small helpers
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === undefined || c === null || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function load(key, fallback) {
    try {
      const v = localStorage.getItem(key);
      return v === null ? fallback : JSON.parse(v);
    } catch (_) {
      return fallback;
    }
  }

  function save(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
    } catch (_) { /* storage full or disabled: the page still works for this visit */ }
  }

  function fmt(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    if (typeof x !== "number") return String(x);
    if (Number.isInteger(x)) return String(x);
    const d = digits === undefined ? (Math.abs(x) >= 100 ? 0 : Math.abs(x) >= 10 ? 1 : 3) : digits;
    return x.toFixed(d);
  }

  function pct(x) {
    return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
  }

  function ms(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    return seconds >= 10 ? seconds.toFixed(1) + " s" : (1000 * seconds).toFixed(seconds < 0.01 ? 2 : 0) + " ms";
  }

  function clock(t) {
    return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
  }

  function uid() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  // ---------------------------------------------------------------- API calls and the key
  function apiKey() {
    return localStorage.getItem(KEY_STORE) || "";
  }

  class AuthError extends Error {}

  async function errorMessage(resp) {
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return body.error.message;
      return JSON.stringify(body);
    } catch (_) {
      return resp.status + " " + resp.statusText;
    }
  }

  // fetch() of /v1/... with the Bearer key; a 401 opens the key prompt and throws AuthError.
  async function api(path, opts) {
    opts = Object.assign({}, opts || {});
    const headers = Object.assign({}, opts.headers || {});
    const key = apiKey();
    if (key) headers["Authorization"] = "Bearer " + key;
    opts.headers = headers;
    const resp = await fetch(path, opts);
    if (resp.status === 401) {
      const msg = await errorMessage(resp);
      showAuth(msg);
      throw new AuthError(msg);
    }
    return resp;
  }

  function showAuth(message) {
    const box = $("auth");
    box.hidden = false;
    $("key-toggle").setAttribute("aria-expanded", "true");
    const err = $("auth-error");
    err.hidden = false;
    err.textContent = (apiKey() ? "The server refused the API key" : "This server needs an API key") +
      (message ? ": " + message : "") + ". Enter it below.";
    $("api-key").focus();
  }

  function hideAuth() {
    $("auth").hidden = true;
    $("auth-error").hidden = true;
    $("key-toggle").setAttribute("aria-expanded", "false");
  }

  $("key-toggle").addEventListener("click", () => {
    if ($("auth").hidden) {
      $("auth").hidden = false;
      $("key-toggle").setAttribute("aria-expanded", "true");
      $("api-key").value = apiKey();
      $("api-key").focus();
    } else {
      hideAuth();
    }
  });

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const v = $("api-key").value.trim();
    if (v) localStorage.setItem(KEY_STORE, v);
    else localStorage.removeItem(KEY_STORE);
    $("api-key").value = "";
    hideAuth();
    loadModel();
    if (currentView === "dashboard") pollNow();
    $("chat-input").focus();
  });

  $("key-clear").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORE);
    $("api-key").value = "";
    $("api-key").focus();
  });

  let modelId = null;

  async function loadModel() {
    try {
      const resp = await api("/v1/models");
      if (!resp.ok) throw new Error(await errorMessage(resp));
      const body = await resp.json();
      modelId = body.data && body.data[0] ? body.data[0].id : null;
      $("model-name").textContent = modelId || "";
      document.title = modelId ? "hetserve: " + modelId : "hetserve";
    } catch (e) {
      if (!(e instanceof AuthError)) $("model-name").textContent = "server unreachable";
    }
  }

  // ---------------------------------------------------------------- views (tabs)
  let currentView = "chat";
  const tabs = [$("tab-chat"), $("tab-dashboard")];

  function showView(name, focusTab) {
    currentView = name;
    document.body.dataset.view = name;
    for (const t of tabs) {
      const on = t.id === "tab-" + name;
      t.setAttribute("aria-selected", on ? "true" : "false");
      t.tabIndex = on ? 0 : -1;
      $(t.getAttribute("aria-controls")).hidden = !on;
      if (on && focusTab) t.focus();
    }
    if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
    if (name === "dashboard") pollNow();
    else stopPolling();
  }

  for (const t of tabs) {
    t.addEventListener("click", () => showView(t.id.slice(4)));
    t.addEventListener("keydown", (ev) => {
      const i = tabs.indexOf(t);
      let j = null;
      if (ev.key === "ArrowRight") j = (i + 1) % tabs.length;
      else if (ev.key === "ArrowLeft") j = (i + tabs.length - 1) % tabs.length;
      else if (ev.key === "Home") j = 0;
      else if (ev.key === "End") j = tabs.length - 1;
      if (j !== null) {
        ev.preventDefault();
        showView(tabs[j].id.slice(4), true);
      }
    });
  }
  window.addEventListener("hashchange", () => {
    const v = location.hash.slice(1);
    if ((v === "chat" || v === "dashboard") && v !== currentView) showView(v);
  });

  // ---------------------------------------------------------------- conversations
  let convs = load(CONV_STORE, []);
  if (!Array.isArray(convs)) convs = [];
  let current = load(CURRENT_STORE, null);

  function conv() {
    return convs.find((c) => c.id === current) || null;
  }

  function persist() {
    save(CONV_STORE, convs);
    save(CURRENT_STORE, current);
  }

  function newConversation() {
    const c = { id: uid(), title: "New conversation", system: $("system-prompt").value, messages: [], updated: Date.now() };
    convs.unshift(c);
    current = c.id;
    persist();
    renderConvList();
    renderMessages();
    return c;
  }

  function selectConversation(id) {
    if (busy) return;
    current = id;
    persist();
    const c = conv();
    $("system-prompt").value = c ? c.system || "" : "";
    renderConvList();
    renderMessages();
  }

  function deleteConversation(id) {
    if (busy && id === current) return;
    convs = convs.filter((c) => c.id !== id);
    if (current === id) current = convs.length ? convs[0].id : null;
    persist();
    const c = conv();
    $("system-prompt").value = c ? c.system || "" : $("system-prompt").value;
    renderConvList();
    renderMessages();
  }

  function renderConvList() {
    const list = $("conv-list");
    list.replaceChildren();
    for (const c of convs) {
      const on = c.id === current;
      list.append(el("li", { class: on ? "conv current" : "conv", "data-testid": "conv-item" },
        el("button", { type: "button", class: "conv-open", "aria-current": on ? "true" : null,
          title: c.title, onclick: () => selectConversation(c.id) }, c.title),
        el("button", { type: "button", class: "conv-delete ghost", "data-testid": "conv-delete",
          "aria-label": "Delete conversation: " + c.title, title: "Delete", onclick: () => deleteConversation(c.id) }, "×")));
    }
  }

  $("new-conv").addEventListener("click", () => {
    if (busy) return;
    newConversation();
    $("chat-input").focus();
  });

  $("system-prompt").addEventListener("input", () => {
    const c = conv();
    if (c) {
      c.system = $("system-prompt").value;
      persist();
    }
  });

  // ---------------------------------------------------------------- settings
  const SETTINGS = [["temperature", "temperature", parseFloat], ["top-p", "top_p", parseFloat],
    ["top-k", "top_k", (v) => parseInt(v, 10)], ["max-tokens", "max_tokens", (v) => parseInt(v, 10)],
    ["seed", "seed", (v) => parseInt(v, 10)]];
  const stored = load(SETTINGS_STORE, {});
  for (const [id] of SETTINGS) {
    if (stored && typeof stored[id] === "string") $(id).value = stored[id];
    $(id).addEventListener("input", () => {
      const s = {};
      for (const [i] of SETTINGS) s[i] = $(i).value;
      save(SETTINGS_STORE, s);
    });
  }

  function samplingFields() {
    const out = {};
    for (const [id, field, parse] of SETTINGS) {
      const raw = $(id).value.trim();
      if (raw === "") continue;
      const v = parse(raw);
      if (!Number.isNaN(v)) out[field] = v;
    }
    return out;
  }

  // ---------------------------------------------------------------- rendering messages
  // ``` fences become <pre><code>; everything else is text. All through text nodes.
  function renderText(container, text) {
    const parts = text.split(/^```/m);
    const frag = document.createDocumentFragment();
    parts.forEach((part, i) => {
      if (i % 2 === 0) {
        // After a closing fence: drop the rest of its line; before an opening one: its newline.
        let t = i > 0 ? part.replace(/^[^\n]*\n?/, "") : part;
        if (i < parts.length - 1) t = t.replace(/\n$/, "");
        if (t) frag.append(el("div", { class: "prose" }, t));
      } else {
        const nl = part.indexOf("\n");
        const lang = nl < 0 ? part.trim() : part.slice(0, nl).trim();
        const code = nl < 0 ? "" : part.slice(nl + 1).replace(/\n$/, "");
        frag.append(el("pre", { class: "code", "data-lang": lang || null, tabindex: "0",
          "aria-label": lang ? lang + " code" : "code" }, el("code", {}, code)));
      }
    });
    container.replaceChildren(frag);
  }

  function statsItems(stats) {
    const items = [];
    if (!stats) return items;
    if (stats.ttft !== undefined) items.push(["ttft", "TTFT " + ms(stats.ttft)]);
    if (stats.tok_s !== undefined) items.push(["toks", fmt(stats.tok_s, 1) + " tok/s"]);
    if (stats.completion_tokens !== undefined) items.push(["tokens", stats.completion_tokens + " tokens"]);
    if (stats.worker) items.push(["worker", "worker " + stats.worker]);
    if (stats.cached_tokens !== undefined) items.push(["cached", stats.cached_tokens + " cached prompt tokens"]);
    if (stats.spec) {
      const { proposed, accepted } = stats.spec;
      items.push(["spec", "spec " + (proposed ? pct(accepted / proposed) : "–") + " accepted (" + accepted + "/" + proposed + ")"]);
    }
    if (stats.disaggregated) items.push(["disagg", "prefill " + stats.disaggregated.prefill + " → decode " + stats.disaggregated.decode]);
    if (stats.finish) items.push(["finish", stats.finish === "stopped" ? "stopped" : "finish: " + stats.finish]);
    return items;
  }

  function renderStats(node, stats) {
    node.replaceChildren(...statsItems(stats).map(([k, v]) => el("span", { class: "stat", "data-stat": k }, v)));
  }

  function messageNode(m, index) {
    const content = el("div", { class: "content", "data-testid": "msg-content" });
    renderText(content, m.content || "");
    const node = el("article", { class: "msg " + m.role, "data-role": m.role, "data-index": index,
      "data-testid": "msg-" + m.role, "aria-label": m.role === "user" ? "You" : "Assistant" },
    el("div", { class: "who", "aria-hidden": "true" }, m.role === "user" ? "You" : "Assistant"), content);
    if (m.role === "assistant") {
      const err = el("p", { class: "msg-error", "data-testid": "msg-error", role: "alert", hidden: !m.error }, m.error || "");
      const stats = el("p", { class: "stats", "data-testid": "msg-stats" });
      renderStats(stats, m.stats);
      node.append(err, stats);
    }
    return node;
  }

  function renderMessages() {
    const box = $("messages");
    const c = conv();
    const msgs = c ? c.messages : [];
    box.replaceChildren();
    if (!msgs.length) box.append(el("p", { class: "empty", id: "messages-empty" }, "Send a message to start."));
    msgs.forEach((m, i) => box.append(messageNode(m, i)));
    toBottom();
    updateButtons();
  }

  // ---------------------------------------------------------------- chat
  let busy = false;
  let controller = null;

  function updateButtons() {
    const c = conv();
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("regenerate").disabled = busy || !c || !c.messages.some((m) => m.role === "user");
    $("new-conv").disabled = busy;
  }

  // The messages scroll inside their box on a wide screen, with the whole page on a phone.
  function scroller() {
    const box = $("messages");
    return getComputedStyle(box).overflowY === "visible" ? document.scrollingElement : box;
  }

  function nearBottom() {
    const s = scroller();
    return s.scrollHeight - s.scrollTop - s.clientHeight < 80;
  }

  function toBottom() {
    const s = scroller();
    s.scrollTop = s.scrollHeight;
  }

  // Parse an SSE body: calls onEvent(obj) for each data line's JSON; returns when [DONE] or the body ends.
  async function readSSE(resp, onEvent) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, cut).replace(/\r$/, "");
          buf = buf.slice(cut + 1);
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          if (data) onEvent(JSON.parse(data));
        }
      }
    } catch (e) {
      reader.cancel().catch(() => {}); // an error event or a bad line: stop reading (the server aborts)
      throw e;
    }
  }

  async function runAssistant(c) {
    const history = c.messages.map((m) => ({ role: m.role, content: m.content }));
    const system = (c.system || "").trim();
    const messages = system ? [{ role: "system", content: system }, ...history] : history;
    const answer = { role: "assistant", content: "", stats: null, error: null };
    c.messages.push(answer);
    c.updated = Date.now();
    persist();
    renderMessages();
    const box = $("messages");
    const node = box.lastElementChild;
    const contentNode = node.querySelector(".content");
    const statsNode = node.querySelector(".stats");
    const errNode = node.querySelector(".msg-error");
    node.classList.add("streaming");
    statsNode.textContent = "generating…";

    busy = true;
    controller = new AbortController();
    updateButtons();
    $("chat-status").textContent = "Generating an answer";

    const body = Object.assign({ messages, stream: true, stream_options: { include_usage: true } }, samplingFields());
    if (modelId) body.model = modelId;
    const t0 = performance.now();
    let tFirst = null;
    let tLast = null;
    let pending = false;
    const stats = {};
    const paint = () => {
      pending = false;
      const stick = nearBottom();
      renderText(contentNode, answer.content);
      if (stick) toBottom();
    };
    try {
      const resp = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await errorMessage(resp));
      await readSSE(resp, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        for (const choice of chunk.choices || []) {
          const text = choice.delta && choice.delta.content;
          if (text) {
            const now = performance.now();
            if (tFirst === null) {
              tFirst = now;
              stats.ttft = (now - t0) / 1000;
              statsNode.textContent = "TTFT " + ms(stats.ttft) + " · generating…";
            }
            tLast = now;
            answer.content += text;
            if (!pending) {
              pending = true;
              requestAnimationFrame(paint);
            }
          }
          if (choice.finish_reason) stats.finish = choice.finish_reason;
        }
        const ext = chunk.hetserve;
        if (ext) {
          if (ext.worker) stats.worker = ext.worker;
          if (typeof ext.cached_tokens === "number") stats.cached_tokens = ext.cached_tokens;
          if (ext.spec) stats.spec = ext.spec;
          if (ext.disaggregated) stats.disaggregated = ext.disaggregated;
        }
        if (chunk.usage) {
          stats.completion_tokens = chunk.usage.completion_tokens;
          stats.prompt_tokens = chunk.usage.prompt_tokens;
          const d = chunk.usage.prompt_tokens_details;
          if (d && typeof d.cached_tokens === "number") stats.cached_tokens = d.cached_tokens;
        }
      });
    } catch (e) {
      if (e.name === "AbortError") {
        stats.finish = "stopped";
      } else if (e instanceof AuthError) {
        answer.error = "Not authorized: " + e.message + ". Enter the API key above, then Regenerate.";
      } else {
        answer.error = "Error: " + (e.message || String(e));
      }
    } finally {
      const tEnd = tLast === null ? performance.now() : tLast;
      const n = stats.completion_tokens;
      if (n && tFirst !== null) {
        // Decode rate: tokens after the first over the time after the first (all of them over TTFT if one).
        stats.tok_s = n > 1 && tEnd > tFirst ? (n - 1) / ((tEnd - tFirst) / 1000) : n / ((tEnd - t0) / 1000);
      }
      answer.stats = Object.keys(stats).length ? stats : null;
      c.updated = Date.now();
      persist();
      paint();
      node.classList.remove("streaming");
      renderStats(statsNode, answer.stats);
      errNode.hidden = !answer.error;
      errNode.textContent = answer.error || "";
      busy = false;
      controller = null;
      updateButtons();
      $("chat-status").textContent = answer.error ? "The answer failed" : "Answer complete";
    }
  }

  function send() {
    if (busy) return;
    const text = $("chat-input").value;
    if (!text.trim()) return;
    let c = conv();
    if (!c) c = newConversation();
    c.system = $("system-prompt").value;
    if (!c.messages.length) {
      c.title = text.trim().replace(/\s+/g, " ").slice(0, 40);
    }
    c.messages.push({ role: "user", content: text });
    // Most recent first in the list.
    convs = [c, ...convs.filter((x) => x.id !== c.id)];
    $("chat-input").value = "";
    renderConvList();
    runAssistant(c);
  }

  function regenerate() {
    if (busy) return;
    const c = conv();
    if (!c) return;
    while (c.messages.length && c.messages[c.messages.length - 1].role !== "user") c.messages.pop();
    if (!c.messages.length) return;
    c.system = $("system-prompt").value;
    runAssistant(c);
  }

  $("chat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  $("chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => {
    if (controller) controller.abort();
    $("chat-input").focus();
  });
  $("regenerate").addEventListener("click", regenerate);

  // ---------------------------------------------------------------- dashboard
  let pollTimer = null;
  let polling = false;
  let lastDash = null;

  function stopPolling() {
    clearTimeout(pollTimer);
    pollTimer = null;
  }

  function pollNow() {
    stopPolling();
    if (!polling) poll();
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
      if (again && currentView === "dashboard") {
        clearTimeout(pollTimer);
        pollTimer = setTimeout(poll, 1000);
      }
    }
  }

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

  function profileTable(title, rows, xLabel) {
    return el("table", { class: "mini" }, el("caption", {}, title),
      el("thead", {}, el("tr", {}, el("th", { scope: "col" }, xLabel), el("th", { scope: "col" }, "tok/s"))),
      el("tbody", {}, ...(rows || []).map(([x, v]) => el("tr", {}, el("td", {}, fmt(x)), el("td", {}, fmt(v, 0))))));
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
      if (!w.profile) body.replaceChildren(el("p", { class: "hint" }, "No profile."));
      else body.replaceChildren(
        el("p", { class: "hint" }, "Measured on " + (w.profile.device || w.device || "?")),
        el("div", { class: "mini-tables" },
          profileTable("Prefill", w.profile.prefill, "tokens"),
          profileTable("Decode", w.profile.decode, "batch")));
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

  const SERIES = [["ttft_p50", "#2b7bd6", []], ["ttft_p99", "#2b7bd6", [5, 4]],
    ["itl_p50", "#d9661f", []], ["itl_p99", "#d9661f", [5, 4]]];

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

  function drawChart(series) {
    const canvas = $("latency-chart");
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(200, canvas.clientWidth);
    const h = canvas.clientHeight || 220;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const css = getComputedStyle(document.body);
    const fg = css.getPropertyValue("--muted").trim() || "#666";
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = fg;
    g.strokeStyle = fg;
    if (!series.length) {
      g.fillText("No requests in the window yet.", 10, h / 2);
      return;
    }
    // Two panels sharing the time axis: TTFT on top, ITL below, each on its own scale.
    const left = 52, right = 8, gap = 18, top = 6, bottom = 16;
    const ph = (h - top - bottom - gap) / 2;
    const t0 = series[0].t, t1 = series[series.length - 1].t;
    const span = Math.max(t1 - t0, 10);
    const x = (t) => left + (w - left - right) * (series.length === 1 ? 0.5 : (t - t0) / span);
    const panels = [["TTFT", ["ttft_p50", "ttft_p99"], top], ["ITL", ["itl_p50", "itl_p99"], top + ph + gap]];
    for (const [label, keys, y0] of panels) {
      let max = 0;
      for (const p of series) for (const k of keys) if (typeof p[k] === "number") max = Math.max(max, p[k]);
      max = max || 0.001;
      const y = (v) => y0 + ph - (ph * v) / max;
      g.globalAlpha = 0.35;
      g.beginPath();
      g.moveTo(left, y0 + ph + 0.5);
      g.lineTo(w - right, y0 + ph + 0.5);
      g.moveTo(left - 0.5, y0);
      g.lineTo(left - 0.5, y0 + ph);
      g.stroke();
      g.globalAlpha = 1;
      g.fillText(label, 2, y0 + 10);
      g.fillText(ms(max), 2, y0 + 24);
      g.fillText("0", left - 12, y0 + ph);
      for (const [k, color, dash] of SERIES) {
        if (!keys.includes(k)) continue;
        g.strokeStyle = color;
        g.fillStyle = color;
        g.setLineDash(dash);
        g.lineWidth = 1.6;
        g.beginPath();
        let drawing = false;
        for (const p of series) {
          const v = p[k];
          if (typeof v !== "number") {
            drawing = false;
            continue;
          }
          if (drawing) g.lineTo(x(p.t), y(v));
          else g.moveTo(x(p.t), y(v));
          drawing = true;
        }
        g.stroke();
        g.setLineDash([]);
        for (const p of series) if (typeof p[k] === "number") g.fillRect(x(p.t) - 1.5, y(p[k]) - 1.5, 3, 3);
      }
      g.strokeStyle = fg;
      g.fillStyle = fg;
    }
    g.fillText(clock(t0), left, h - 3);
    const endLabel = clock(t1);
    g.fillText(endLabel, w - right - g.measureText(endLabel).width, h - 3);
  }

  window.addEventListener("resize", () => {
    if (lastDash && currentView === "dashboard") drawChart((lastDash.latency && lastDash.latency.series) || []);
  });

  // ---------------------------------------------------------------- start
  if (!conv()) current = convs.length ? convs[0].id : null;
  const c0 = conv();
  if (c0) $("system-prompt").value = c0.system || "";
  renderConvList();
  renderMessages();
  loadModel();
  showView(location.hash === "#dashboard" ? "dashboard" : "chat");
  // For tests and debugging: the last dashboard payload.
  window.hetserve = { get dashboard() { return lastDash; } };
})();
