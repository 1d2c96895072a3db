"""`hetserve bench disagg`: prefill/decode disaggregation between two unequal workers.

Modes (a fresh `hetserve serve` with both workers per mode, so each mode pays the same
start-up and shares the machine the same way):
  PD@A    prefill and decode on worker A (--route-policy force:<A>)
  P@A/D@B prefill on A, KV moved to B, decode on B (--disaggregate prefill=<A>,decode=<B>)
  PD@B    prefill and decode on worker B (--route-policy force:<B>)
Workloads: LILO, LISO, SILO, SISO (long = --long tokens, short = --short; input then output),
--concurrency requests sent at once, random token-id prompts, EOS ignored, greedy.

Per mode and workload: prefill time (median TTFT: queueing + prefill + first token), KV transfer
time (median per request, from the route log; 0 without a split), decode time (median of
E2E - TTFT), total (wall time of the whole batch), total tok/s (prompt + output tokens / wall),
TTFT median and p95, and a ratio table (each mode's total time / PD@A's).

Default workers on a CPU-only machine (one core each): A = cpu:threads=1,weight_format=fp32,
B = cpu:threads=1,weight_format=int8 (about the same prefill, about 3x faster decode), so the
split decodes on the faster decoder. With a GPU: A = cuda, B = cpu:threads=<cores - 2>.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time

from ..flags import add_model_flag
from . import plots
from .routing import _names, _Server, _stream  # the same worker names, server handling and stream client

WORKLOADS = ("LILO", "LISO", "SILO", "SISO")


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


class _DisaggServer(_Server):
    def __init__(self, args, devices, mode: str, names: list[str], route_log: str):
        import subprocess

        from .routing import _free_port

        policy = f"force:{names[1] if mode == 'PD@B' else names[0]}"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"

        cmd = [sys.executable, "-m", "hetserve.cli", "serve", "--model", args.model, "--port", str(self.port),
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--kv-cache-memory", args.kv_cache_memory, "--route-policy", policy, "--route-log", route_log,
               "--no-startup-profile"]
        for d in devices:
            cmd += ["--inference-device", d]
        if mode == "P@A/D@B":
            cmd += ["--disaggregate", f"prefill={names[0]},decode={names[1]}"]
        if args.ray_address:
            cmd += ["--ray-address", args.ray_address]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _batch(url: str, prompts: list[list[int]], output_tokens: int) -> tuple[list[dict], float]:
    import httpx

    async with httpx.AsyncClient(timeout=3600) as c:
        t0 = time.perf_counter()
        bodies = [{"prompt": p, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}} for p in prompts]
        results = await asyncio.gather(*[_stream(c, url, b, t0) for b in bodies])
        return list(results), time.perf_counter() - t0


def run_mode(args, devices, names, mode: str, out_dir: str) -> dict:
    log = os.path.join(out_dir, f"route-{mode.replace('/', '_').replace('@', '')}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    server = _DisaggServer(args, devices, mode, names, log)
    rows = {}
    try:
        server.wait()
        rng = random.Random(0)
        import asyncio as _a

        _a.run(_batch(server.url, [[rng.randrange(1, 300) for _ in range(16)]], 4))  # warm-up
        for wl in args.workloads:
            n_in = args.long if wl[0] == "L" else args.short
            n_out = args.long if wl[2] == "L" else args.short
            prompts = [[rng.randrange(1, 300) for _ in range(n_in)] for _ in range(args.concurrency)]
            before = _transfers(log)
            results, wall = _a.run(_batch(server.url, prompts, n_out))
            moves = _transfers(log)[len(before):]
            ttft = [r["ttft"] for r in results]
            out_tokens = sum(r["output_tokens"] for r in results)
            rows[wl] = {
                "prefill_s": statistics.median(ttft),
                "transfer_s": statistics.median([m["transfer_s"] for m in moves]) if moves else 0.0,
                "transfer_bytes": statistics.median([m["bytes"] for m in moves]) if moves else 0,
                "decode_s": statistics.median([r["e2e"] - r["ttft"] for r in results]),
                "total_s": wall,
                "tok_s": (n_in * len(prompts) + out_tokens) / wall,
                "ttft_median_s": statistics.median(ttft), "ttft_p95_s": _p95(ttft),
                "output_tokens": out_tokens, "failed_transfers": sum(1 for m in moves if not m["ok"]),
            }
            print(f"  {mode:8s} {wl}: total {wall:.2f}s", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows


def _transfers(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [x for x in (json.loads(line) for line in f) if x.get("event") == "kv_transfer"]


def _default_devices() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return ["cuda", f"cpu:threads={max((os.cpu_count() or 1) - 2, 1)}"]
    return ["cpu:threads=1,weight_format=fp32", "cpu:threads=1,weight_format=int8"]


MODES = ("PD@A", "P@A/D@B", "PD@B")


def table(results: dict, workloads: list[str]) -> str:
    cols = ("prefill_s", "transfer_s", "decode_s", "total_s", "tok_s", "ttft_median_s", "ttft_p95_s")
    lines = [f"{'mode':9s} {'load':5s} " + " ".join(f"{c:>13s}" for c in cols)]
    for m in MODES:
        for wl in workloads:
            r = results[m][wl]
            lines.append(f"{m:9s} {wl:5s} " + " ".join(f"{r[c]:13.3f}" for c in cols))
    lines.append("")
    lines.append("total time relative to PD@A (lower is better)")
    lines.append(f"{'load':5s} " + " ".join(f"{m:>9s}" for m in MODES))
    for wl in workloads:
        base = results["PD@A"][wl]["total_s"]
        lines.append(f"{wl:5s} " + " ".join(f"{results[m][wl]['total_s'] / base:9.2f}" for m in MODES))
    lines.append("")
    lines.append("speed-up of the split over PD on the decode worker (PD@B total / P@A/D@B total; the")
    lines.append("study's P-GPU/D-CPU vs PD-CPU: LILO 1.61, LISO 1.43, SILO 0.92, SISO 0.75)")
    for wl in workloads:
        lines.append(f"{wl:5s} {results['PD@B'][wl]['total_s'] / results['P@A/D@B'][wl]['total_s']:9.2f}")
    return "\n".join(lines)


def plot(saved: dict, path: str) -> bool:
    """Total time, total tok/s and TTFT (median, p95 whisker) per workload and mode."""
    results, workloads = saved["results"], list(saved["results"]["PD@A"])

    def series(key):
        return {m: [results[m][wl][key] for wl in workloads] for m in MODES}
    names, devices = saved["workers"], saved["devices"]
    return plots.bar_panels(
        path, f"disaggregation: A = {names[0]} ({devices[0]}), B = {names[1]} ({devices[1]}), "
              f"{saved['concurrency']} concurrent requests", workloads,
        [("total time of the batch (s)", series("total_s"), None),
         ("total tok/s (prompt + output)", series("tok_s"), None),
         ("TTFT median, p95 whisker (s)", series("ttft_median_s"), series("ttft_p95_s"))])


def main(args) -> int:
    if args.from_json:  # redraw the table and plot of a saved run
        with open(args.from_json) as f:
            saved = json.load(f)
        print(table(saved["results"], list(saved["results"]["PD@A"])))
        out = os.path.join(os.path.dirname(args.from_json) or ".", "disagg.png")
        if plot(saved, out):
            print(f"plot: {out}")
        return 0
    devices = args.inference_device or _default_devices()
    if len(devices) != 2:
        print("error: bench disagg needs exactly two --inference-device values (A, then B)", file=sys.stderr)
        return 2
    names = _names(devices)
    os.makedirs(args.out, exist_ok=True)
    print(f"bench disagg: A = {names[0]} ({devices[0]}), B = {names[1]} ({devices[1]}); "
          f"{args.concurrency} concurrent requests; long = {args.long}, short = {args.short} tokens",
          file=sys.stderr, flush=True)
    results = {m: run_mode(args, devices, names, m, args.out) for m in MODES}
    print(table(results, args.workloads))
    cmd = "hetserve bench disagg " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "hetserve bench disagg"
    saved = {"devices": devices, "workers": names, "concurrency": args.concurrency, "long": args.long,
             "short": args.short, "results": results, "command": cmd}
    with open(os.path.join(args.out, "disagg.json"), "w") as f:
        json.dump(saved, f, indent=1)
    if plot(saved, os.path.join(args.out, "disagg.png")):
        print(f"plot: {os.path.join(args.out, 'disagg.png')}")
    print(f"\nreproduce: {cmd}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("disagg", help="prefill/decode disaggregation: PD on A, P on A / D on B, PD on B")
    add_model_flag(p)
    p.add_argument("--inference-device", action="append", default=None,
                   help="worker A then worker B. Default without a GPU: cpu:threads=1,weight_format=fp32 "
                        "then cpu:threads=1,weight_format=int8")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--ray-address", default=None, help="the Ray cluster of ray: devices (passed to the servers)")
    p.add_argument("--concurrency", type=int, default=4, help="requests sent at once per workload")
    p.add_argument("--long", type=int, default=512)
    p.add_argument("--short", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--out", default="bench-disagg", help="directory for route logs, disagg.json and disagg.png")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="print the table and draw the plot of a saved disagg.json; runs nothing")
    p.set_defaults(func=main)
