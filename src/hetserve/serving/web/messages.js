// One chat message in the page: its text (``` fences as code blocks) and, for an answer, its error
// and stats line. Model output only goes through text nodes.
import { el, fmt, ms, pct } from "./dom.js";

// ``` fences become <pre><code>; everything else is text. All through text nodes.
export function renderText(container, text) {
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

export function renderStats(node, stats) {
  node.replaceChildren(...statsItems(stats).map(([k, v]) => el("span", { class: "stat", "data-stat": k }, v)));
}

export function messageNode(m, index) {
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
