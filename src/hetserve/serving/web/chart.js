// The dashboard's latency chart on its <canvas>: TTFT and inter-token latency, p50 and p99, over time.
import { $, clock, ms } from "./dom.js";

const SERIES = [["ttft_p50", "#2b7bd6", []], ["ttft_p99", "#2b7bd6", [5, 4]],
  ["itl_p50", "#d9661f", []], ["itl_p99", "#d9661f", [5, 4]]];

export function drawChart(series) {
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
