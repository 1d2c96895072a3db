"""`hetserve bench tracing`: what traces cost. Decode tok/s of one stream with tracing off vs on
(alternating runs, medians), and the cost of the instrumentation when off: the time of one
disabled span times the spans a decode step opens, as a fraction of the step. From the traced
runs it also splits a decode step into matmul time and everything else (attention, norms,
rope, sampling, Python), the overhead the CPU fast path works on."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs


def span_totals(events: list[dict]) -> dict[str, list[float]]:
    """Durations (ms) of every B/E span, by name; "matmul" totals are summed per enclosing step."""
    stacks: dict[tuple, list] = {}
    out: dict[str, list[float]] = {"step": [], "matmul": []}
    for e in events:
        if e["ph"] == "B":
            stacks.setdefault((e["pid"], e["tid"]), []).append(e)
            if e["name"] == "step":
                out["matmul"].append(0.0)
        elif e["ph"] == "E":
            b = stacks[(e["pid"], e["tid"])].pop()
            ms = (e["ts"] - b["ts"]) / 1e3
            if b["name"] == "step":
                out["step"].append(ms)
            elif b["name"] == "matmul" and out["matmul"]:
                out["matmul"][-1] += ms
    return out


def main(args) -> int:
    from .. import trace
    from ..llm import LLM
    from ..sampling_params import SamplingParams
    from .latency import prompt_ids

    kw = engine_kwargs(args)
    kw.pop("trace_directory")
    llm = LLM(model=args.model, **kw)
    ids = prompt_ids(llm.tokenizer, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)

    def decode_rate() -> float:
        out = llm.generate([ids], params, use_tqdm=False)[0]
        return (len(out.token_ids) - 1) / (out.metrics["finished_time"] - out.metrics["first_token_time"])

    decode_rate()  # warm-up
    off, on, spans_per_step, step_ms, matmul_ms = [], [], 0.0, [], []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.runs):
            off.append(decode_rate())
            trace.start(d, "bench")
            on.append(decode_rate())
            path = trace.stop()
            with open(path) as f:
                events = json.load(f)["traceEvents"]
            steps = sum(1 for e in events if e["ph"] == "B" and e["name"] == "step")
            spans_per_step = sum(1 for e in events if e["ph"] == "B") / max(steps, 1)
            totals = span_totals(events)
            step_ms += totals["step"][1:]  # the first step is the prefill
            matmul_ms += totals["matmul"][1:len(totals["step"])]
    n = 200_000
    t = time.perf_counter()
    for _ in range(n):
        with trace.span("matmul", op="q", impl="gemm", rows=1):
            pass
    disabled_ns = (time.perf_counter() - t) / n * 1e9
    off_m, on_m = statistics.median(off), statistics.median(on)
    step_ns = 1e9 / off_m
    report = {
        "benchmark": "tracing", "model": args.model, "command": " ".join(sys.argv),
        "decode_tok_s_off": round(off_m, 3), "decode_tok_s_on": round(on_m, 3),
        "on_vs_off_pct": round(100 * (on_m - off_m) / off_m, 2),
        "spans_per_step": round(spans_per_step, 1), "disabled_span_ns": round(disabled_ns, 1),
        "off_vs_uninstrumented_pct": round(100 * spans_per_step * disabled_ns / step_ns, 4),
        "runs": {"off": [round(x, 3) for x in off], "on": [round(x, 3) for x in on]},
        "decode_step_ms": round(statistics.median(step_ms), 3),
        "decode_step_matmul_ms": round(statistics.median(matmul_ms), 3),
        "decode_step_other_ms": round(statistics.median(s - m for s, m in zip(step_ms, matmul_ms)), 3),
    }
    print(f"decode tok/s: tracing off {off_m:.2f}, on {on_m:.2f} ({report['on_vs_off_pct']:+.2f}%)")
    print(f"instrumentation when off: {spans_per_step:.0f} spans/step x {disabled_ns:.0f} ns = "
          f"{report['off_vs_uninstrumented_pct']:.3f}% of a {step_ns / 1e6:.1f} ms step")
    print(f"traced decode step: {report['decode_step_ms']:.2f} ms, of which matmuls "
          f"{report['decode_step_matmul_ms']:.2f} ms and everything else {report['decode_step_other_ms']:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("tracing", help="decode speed with tracing off vs on, and the cost of disabled spans")
    add_model_flag(p)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None)
    add_engine_flags(p)
    p.set_defaults(func=main)
