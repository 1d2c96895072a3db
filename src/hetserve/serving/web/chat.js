// The chat view: the conversations in the sidebar, the system prompt and sampling settings, the
// messages, and an answer streamed from /v1/chat/completions with its stats.
import { $, el, ms } from "./dom.js";
import { loadConversations, loadSettings, saveConversations, saveSettings } from "./storage.js";
import { api, AuthError, errorMessage, modelId, readSSE } from "./api.js";
import { messageNode, renderStats, renderText } from "./messages.js";

function uid() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

// ---------------------------------------------------------------- conversations
let convs = [];
let current = null;

function conv() {
  return convs.find((c) => c.id === current) || null;
}

function persist() {
  saveConversations(convs, current);
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

// ---------------------------------------------------------------- settings
const SETTINGS = [["temperature", "temperature", parseFloat], ["top-p", "top_p", parseFloat],
  ["top-k", "top_k", (v) => parseInt(v, 10)], ["max-tokens", "max_tokens", (v) => parseInt(v, 10)],
  ["seed", "seed", (v) => parseInt(v, 10)]];

// The fields as typed last time, and kept as they are typed.
function initSettings() {
  const stored = loadSettings();
  for (const [id] of SETTINGS) {
    if (stored && typeof stored[id] === "string") $(id).value = stored[id];
    $(id).addEventListener("input", () => {
      const s = {};
      for (const [i] of SETTINGS) s[i] = $(i).value;
      saveSettings(s);
    });
  }
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

// ---------------------------------------------------------------- messages
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

// ---------------------------------------------------------------- an answer
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

// ---------------------------------------------------------------- start
// The stored conversations and settings, the controls' handlers, and the open conversation shown.
export function initChat() {
  ({ convs, current } = loadConversations());

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

  initSettings();

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

  if (!conv()) current = convs.length ? convs[0].id : null;
  const c0 = conv();
  if (c0) $("system-prompt").value = c0.system || "";
  renderConvList();
  renderMessages();
}
