// hetserve's web page: a streaming chat and a live view of the workers and the router.
// Plain JS modules, no framework, no build step, no external URL. Model output is only ever put in
// the page through textContent / text nodes, never innerHTML.
//
// This is the entry (index.html loads it as a module): it wires the views (tabs) and the API key
// prompt and starts the page. The rest, by concern:
//   dom.js        $, el and the formatting of numbers and times
//   storage.js    localStorage: the API key, the conversations, the sampling settings
//   auth.js       the API key prompt
//   api.js        fetch() of /v1 with the key, error bodies, SSE streams, the served model
//   messages.js   one chat message: text, code blocks, stats line
//   chat.js       the chat view: conversations, settings, streaming an answer
//   dashboard.js  the dashboard view: polling, worker cards, routing decisions, latency
//   chart.js      the latency chart
import { $ } from "./dom.js";
import { initAuth } from "./auth.js";
import { loadModel } from "./api.js";
import { initChat } from "./chat.js";
import { hideDashboard, initDashboard, lastDash, refreshDashboard, showDashboard } from "./dashboard.js";

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
  if (name === "dashboard") showDashboard();
  else hideDashboard();
}

// ---------------------------------------------------------------- start
initAuth(() => {
  loadModel();
  refreshDashboard();
  $("chat-input").focus();
});

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

initChat();
initDashboard();
loadModel();
showView(location.hash === "#dashboard" ? "dashboard" : "chat");
// For tests and debugging: the last dashboard payload.
window.hetserve = { get dashboard() { return lastDash; } };
