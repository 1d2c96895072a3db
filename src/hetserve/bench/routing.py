"""`hetserve bench routing`: forced routing to the fast worker vs cost routing, real or simulated.

The experiment (the reference engine's): two workers of very different speed; a prefix of
--prefix-tokens seeded into every worker's cache (one pinned request each); bursts of
--bursts requests, each a --prompt-tokens prompt sharing that prefix, --output-tokens output
tokens (EOS ignored), sent --interval seconds apart without waiting; at most --max-num-seqs
active requests per worker; a fresh server per case; --runs runs. Reports whole-burst
completion time, output throughput, TTFT and E2E median and p95, and requests per worker.

Modes:
  (default)    real runs: `hetserve serve` subprocesses on --inference-device values,
               loaded over HTTP. Profiles come from --profile files, or are measured first
               with `hetserve profile` (written to --out).
  --simulate   no hardware: the discrete-event model (bench/routing_sim.py) on --profile
               files (any number of workers; --bursts may be thousands).
  --validate   real runs, each replayed in the simulator with the same arrival times,
               prompts and profiles; prints the simulator's error per run and overall.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

from ..flags import add_model_flag
from . import plots
from .routing_sim import SimRequest, simulate, summary

METRICS = ("completion_s", "output_tok_s", "ttft_median_s", "ttft_p95_s", "e2e_median_s", "e2e_p95_s")


def _default_devices() -> list[str]:
    """Two workers of different speed on this machine, each on its own cores."""
    import torch

    cores = os.cpu_count() or 1
    if torch.cuda.is_available():  # one core left for the GPU worker, one for the API process and the client
        return ["cuda", f"cpu:threads={max(cores - 2, 1)}"]
    if cores >= 4:  # many threads vs one; one core left for the API process and the client
        return [f"cpu:threads={cores - 2}", "cpu:threads=1"]
    # Two cores: one each. The fast one decodes with int8 weights, the slow one with fp32 (about
    # 3x slower decode, the same fp32 GEMM prefill): unequal the way a GPU and a CPU are at decode.
    return ["cpu:threads=1,weight_format=int8", "cpu:threads=1,weight_format=fp32"]


def _names(devices: list[str]) -> list[str]:
    from ..serving.devices import parse_devices

    return [s.name for s in parse_devices(devices, {}, "float32")]


def _profiles(args, devices: list[str]) -> list[dict]:
    if args.profile:
        profs = []
        for path in args.profile:
            with open(path) as f:
                profs.append(json.load(f))
        return profs
    profs = []
    for i, d in enumerate(devices):
        out = os.path.join(args.out, f"profile-{i}.json")
        print(f"measuring {d} -> {out}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "hetserve.cli", "profile", "--model", args.model, "--inference-device", d,
               "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory, "--out", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            profs.append(json.load(f))
    return profs


# -- one real case ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, args, devices, policy, profile_paths, route_log):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hetserve.cli", "serve", "--model", args.model, "--port", str(self.port),
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--kv-cache-memory", args.kv_cache_memory, "--route-log", route_log]
        # `cost+static`: cost routing on the profiles as given (not refined from the workers' steps)
        cmd += ["--route-policy", policy.removesuffix("+static")] + (
            ["--profile-refine", "off"] if policy.endswith("+static") else [])
        for d in devices:
            cmd += ["--inference-device", d]
        for p in profile_paths:
            cmd += ["--profile", p]
        if args.ray_address:
            cmd += ["--ray-address", args.ray_address]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(self, timeout: float = 900) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _stream(c, url: str, body: dict, t0: float) -> dict:
    sent = time.perf_counter() - t0
    first, n = None, 0
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"]["message"])
            if data.get("usage"):
                n = data["usage"]["completion_tokens"]
            if first is None and any(ch.get("text") for ch in data.get("choices", [])):
                first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return {"sent": sent, "ttft": (first if first is not None else end) - sent, "e2e": end - sent, "end": end,
            "output_tokens": n}


async def _burst(url: str, args, names: list[str], seed: int) -> tuple[list[dict], list[list[int]], list[int]]:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(7200.0), limits=httpx.Limits(max_connections=1000)) as c:
        async def tokenize(text: str) -> list[int]:
            return (await c.post(url + "/tokenize", json={"prompt": text})).json()["tokens"]

        nonce = random.Random(seed).getrandbits(32)
        body = await tokenize("def merge_sort(items):\n    if len(items) <= 1:\n        return items\n" * 8)
        body = body * (args.prompt_tokens // len(body) + 2)
        prefix = ((await tokenize(f"# shared context {nonce}\n")) + body)[: args.prefix_tokens]
        tail_len = args.prompt_tokens - args.prefix_tokens
        for i, name in enumerate(names):  # seed the prefix into every worker's cache
            seed_prompt = prefix + ((await tokenize(f"# seed {i}\n")) + body)[:8]
            await _stream(c, url, {"prompt": seed_prompt, "max_tokens": 1, "worker": name, "stream": True},
                          time.perf_counter())
        prompts = [prefix + ((await tokenize(f"# request {nonce}-{i}\n")) + body)[:tail_len]
                   for i in range(args.num_requests)]
        # --hog-core: a busy loop on that core from the burst's start to its end (something
        # outside hetserve slowing one worker under load).
        hog = None if args.hog_core is None else subprocess.Popen(
            [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{args.hog_core}}})\nwhile True: pass"])
        try:
            t0 = time.perf_counter()
            tasks = []
            for i, p in enumerate(prompts):  # sent on a fixed clock, without waiting for answers
                delay = t0 + i * args.interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(_stream(c, url, {
                    "prompt": p, "max_tokens": args.output_tokens, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}, t0)))
            return await asyncio.gather(*tasks), prompts, prefix
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()


def real_case(args, devices, names, policy, profile_paths, run: int) -> dict:
    log = os.path.join(args.out, f"route-{args.num_requests}-{policy.replace(':', '_')}-{run}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    server = _Server(args, devices, policy, profile_paths, log)
    try:
        server.wait()
        results, prompts, prefix = asyncio.run(_burst(server.url, args, names, seed=run))
    finally:
        server.stop()
    with open(log) as f:
        routed = [json.loads(line) for line in f][len(names):]  # the seeds come first
    reqs = []
    for res, line in zip(results, routed):
        r = SimRequest(res["sent"], [], args.output_tokens, worker=line["choice"], generated=res["output_tokens"])
        r.first_token, r.finish = res["sent"] + res["ttft"], res["end"]
        reqs.append(r)
    return {"summary": summary(reqs), "requests": [{"sent": r.arrival, "ttft": r.ttft, "e2e": r.e2e,
                                                    "worker": r.worker} for r in reqs],
            "prompt_lens": [len(p) for p in prompts], "prefix_len": len(prefix)}


# -- simulation -------------------------------------------------------------------------------------
def _sim_workload(args, arrivals: list[float] | None = None) -> tuple[list[SimRequest], list[int]]:
    prefix = [1 + i % 30000 for i in range(args.prefix_tokens)]
    tail = args.prompt_tokens - args.prefix_tokens
    reqs = [SimRequest(arrivals[i] if arrivals else i * args.interval,
                       prefix + [40000 + (i * tail + j) % 100000 for j in range(tail)], args.output_tokens)
            for i in range(args.num_requests)]
    return reqs, prefix + [0] * 8


def sim_case(args, named_profiles, policy: str, arrivals: list[float] | None = None) -> dict:
    reqs, seed = _sim_workload(args, arrivals)
    simulate(named_profiles, reqs, policy, args.max_num_seqs, args.max_num_batched_tokens, seed_prefix=seed)
    return {"summary": summary(reqs), "requests": [{"sent": r.arrival, "ttft": r.ttft, "e2e": r.e2e,
                                                    "worker": r.worker} for r in reqs]}


# -- reporting --------------------------------------------------------------------------------------
def _median_summary(cases: list[dict]) -> dict:
    out = {k: statistics.median(c["summary"][k] for c in cases) for k in METRICS}
    out["per_worker"] = [c["summary"]["per_worker"] for c in cases]
    return out


def _table(rows: list[tuple[int, str, dict]], baseline: str) -> str:
    lines = ["| requests | policy | completion s | output tok/s | TTFT med / p95 s | E2E med / p95 s | "
             "requests per worker | vs forced |", "|---|---|---|---|---|---|---|---|"]
    base = {n: m for n, p, m in rows if p == baseline}
    for n, policy, m in rows:
        b = base.get(n)
        vs = "" if b is None or policy == baseline else (
            f"completion {100 * (m['completion_s'] / b['completion_s'] - 1):+.1f}%, "
            f"throughput {100 * (m['output_tok_s'] / b['output_tok_s'] - 1):+.1f}%")
        per = "; ".join(", ".join(f"{k} {v}" for k, v in sorted(pw.items())) for pw in m["per_worker"])
        lines.append(f"| {n} | {policy} | {m['completion_s']:.2f} | {m['output_tok_s']:.1f} | "
                     f"{m['ttft_median_s']:.2f} / {m['ttft_p95_s']:.2f} | {m['e2e_median_s']:.2f} / "
                     f"{m['e2e_p95_s']:.2f} | {per} | {vs} |")
    return "\n".join(lines)


def _plot(rows, path: str, title: str) -> bool:
    bursts = sorted({n for n, _, _ in rows})
    policies = list(dict.fromkeys(p for _, p, _ in rows))

    def series(key):
        return {policy: [next((m[key] for n, p, m in rows if n == b and p == policy), 0) for b in bursts]
                for policy in policies}
    return plots.bar_panels(path, title, [f"{b} requests" for b in bursts], [
        ("whole-burst completion (s)", series("completion_s"), None),
        ("output throughput (tok/s)", series("output_tok_s"), None),
        ("E2E p95 (s)", series("e2e_p95_s"), None)])


def _errors(real: dict, sim: dict) -> dict:
    def rel(a, b):
        return abs(b - a) / a if a else 0.0

    pairs = list(zip(real["requests"], sim["requests"]))
    return {"completion_err": rel(real["summary"]["completion_s"], sim["summary"]["completion_s"]),
            "e2e_mean_abs_err": statistics.mean(rel(r["e2e"], s["e2e"]) for r, s in pairs),
            "ttft_mean_abs_err": statistics.mean(rel(r["ttft"], s["ttft"]) for r, s in pairs),
            "same_worker": sum(r["worker"] == s["worker"] for r, s in pairs) / len(pairs)}


def main(args) -> int:
    from ..serving.router import Profile

    os.makedirs(args.out, exist_ok=True)
    if args.simulate and not args.profile:
        print("error: --simulate needs --profile files (from `hetserve profile`)", file=sys.stderr)
        return 2
    devices = args.inference_device or ([Profile.from_json(json.load(open(p))).device for p in args.profile]
                                        if args.simulate else _default_devices())
    names = _names(devices)
    profs = _profiles(args, devices)
    named = [(n, Profile.from_json(p)) for n, p in zip(names, profs)]
    if len(named) != len(names):
        print("error: give one --profile per worker", file=sys.stderr)
        return 2
    profile_paths = []
    for i, p in enumerate(profs):
        p = dict(p, device=devices[i])  # the server matches a profile to its --inference-device value
        profile_paths.append(os.path.join(args.out, f"profile-{i}.json"))
        with open(profile_paths[-1], "w") as f:
            json.dump(p, f)
    policies = args.policies or [f"force:{names[0]}", "cost"]
    mode = "simulated" if args.simulate else "real"
    rows, report, errors = [], {"benchmark": "routing", "mode": mode, "devices": devices, "workers": names,
                                "profiles": profs, "command": " ".join(sys.argv), "cases": []}, []
    bursts = args.bursts
    for n in bursts:
        args.num_requests = n
        for policy in policies:
            cases = []
            for run in range(1 if args.simulate else args.runs):
                if args.simulate:
                    case = sim_case(args, named, policy)
                else:
                    case = real_case(args, devices, names, policy, profile_paths, run)
                    if args.validate:
                        sim = sim_case(args, named, policy, [r["sent"] for r in case["requests"]])
                        case["simulated"] = sim
                        case["errors"] = err = _errors(case, sim)
                        errors.append(err)
                        real_s, sim_s = case["summary"]["completion_s"], sim["summary"]["completion_s"]
                        print(f"  validate {n} {policy} run {run}: completion real {real_s:.2f}s sim {sim_s:.2f}s "
                              f"({100 * err['completion_err']:.1f}%), E2E mean |err| "
                              f"{100 * err['e2e_mean_abs_err']:.1f}%, same worker {100 * err['same_worker']:.0f}%",
                              flush=True)
                cases.append(case)
                s = case["summary"]
                route = f", routing {s['route_ms_median']:.3f} ms/request (p95 {s['route_ms_p95']:.3f})" \
                    if "route_ms_median" in s else ""
                print(f"{mode} {n} requests, {policy}, run {run}: completion {s['completion_s']:.2f}s, "
                      f"{s['output_tok_s']:.1f} tok/s, per worker {s['per_worker']}{route}", flush=True)
            m = _median_summary(cases)
            rows.append((n, policy, m))
            report["cases"].append({"requests": n, "policy": policy, "median": m, "runs": cases})
    table = _table(rows, policies[0])
    print(f"\n{mode}: {', '.join(f'{n} = {d}' for n, d in zip(names, devices))}; medians of "
          f"{1 if args.simulate else args.runs} run(s)\n{table}")
    if errors:
        e = report["validation"] = {k: statistics.mean(x[k] for x in errors) for k in errors[0]}
        print(f"\nsimulator vs real, mean over {len(errors)} runs: completion time {100 * e['completion_err']:.1f}%, "
              f"per-request E2E {100 * e['e2e_mean_abs_err']:.1f}%, TTFT {100 * e['ttft_mean_abs_err']:.1f}%, "
              f"same worker {100 * e['same_worker']:.0f}%")
    report["table"] = table
    with open(os.path.join(args.out, f"routing-{mode}.json"), "w") as f:
        json.dump(report, f, indent=1)
    if _plot(rows, os.path.join(args.out, f"routing-{mode}.png"), f"routing ({mode}): {', '.join(devices)}"):
        print(f"plot: {os.path.join(args.out, f'routing-{mode}.png')}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("routing", help="forced vs cost routing over unequal workers (real, simulated or both)")
    add_model_flag(p)
    p.add_argument("--inference-device", action="append", default=None,
                   help="a worker (repeatable; the first is the fast one that forced routing uses). Default: "
                        "cuda + cpu:threads=<cores-2> with a GPU; else cpu:threads=<cores-2> + cpu:threads=1 with "
                        "4 or more cores; else cpu:threads=1,weight_format=int8 + cpu:threads=1,weight_format=fp32")
    p.add_argument("--profile", action="append", default=[], help="worker profiles, one per worker, in order")
    p.add_argument("--ray-address", default=None, help="the Ray cluster of ray: devices (passed to the servers)")
    p.add_argument("--policies", nargs="+", default=None,
                   help="default: force:<first worker> cost; cost+static: cost on the profiles as given, not "
                        "refined from the workers' steps")
    p.add_argument("--hog-core", type=int, default=None,
                   help="real runs: a busy loop pinned to this core during each burst (a worker slowed under load)")
    p.add_argument("--bursts", type=int, nargs="+", default=[8, 48])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=516)
    p.add_argument("--prefix-tokens", type=int, default=496)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between requests of a burst")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--simulate", action="store_true", help="no hardware: the discrete-event model on --profile")
    p.add_argument("--validate", action="store_true", help="replay every real run in the simulator; print the error")
    p.add_argument("--out", default="bench-routing", help="directory for profiles, route logs, JSON and plots")
    p.set_defaults(func=main)
