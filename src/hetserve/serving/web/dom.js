// Building the page: `$`, `el` and the formatting of numbers, durations and times.
// Text is only ever put in the page through textContent / text nodes, never innerHTML.

export const $ = (id) => document.getElementById(id);

// el("p", { class: "x", text: "...", onclick: fn, "data-testid": "y" }, ...children): an attribute that
// is undefined, null or false is left out, true gives an empty one; a child that is not a Node is text.
export function el(tag, attrs, ...children) {
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

export function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const d = digits === undefined ? (Math.abs(x) >= 100 ? 0 : Math.abs(x) >= 10 ? 1 : 3) : digits;
  return x.toFixed(d);
}

export function pct(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
}

export function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds >= 10 ? seconds.toFixed(1) + " s" : (1000 * seconds).toFixed(seconds < 0.01 ? 2 : 0) + " ms";
}

export function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}
