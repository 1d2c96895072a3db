"""`hetserve bench prefix-cache`: warm reuse, publication policy, single-flight (medians of --runs).

1. warm reuse: TTFT of a 904-token prompt, cold vs with its 880-token document cached.
2. publication: a request starts; after its first output token, N followers with the same
   prompt arrive; mean follower TTFT with `completion` vs `incremental` publication
   (single-flight off, so only publication differs). A follower's TTFT is settled at its
   first token, so each run stops once every follower has one.
3. simultaneous identical requests: N copies of a 532-token prompt submitted at once, 128
   output tokens each (EOS ignored): mean TTFT and slowest completion for independent
   execution (prefix caching off), single-flight at-completion and after-prefill.

Drives the engine through its Python API (EngineCore.add_request / step), timing each
request from its arrival.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs
from .throughput import make_prompts


def _engine(args, **overrides):
    from ..llm import LLM

    kw = engine_kwargs(args)
    kw.update(overrides)
    return LLM(model=args.model, **kw)


def _params(max_tokens: int):
    from ..sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _request(rid: str, ids: list[int], max_tokens: int):
    from ..core.request import Request

    return Request(rid, ids, _params(max_tokens))


def _ttft(req) -> float:
    return req.metrics.first_token_time - req.metrics.arrival_time


def warm_reuse(llm, docs: list[list[int]], suffix: list[int], runs: int) -> dict:
    cold, warm = [], []
    eng = llm.engine
    for r in range(runs):
        doc = docs[r]
        req = _request(f"cold{r}", doc + suffix, 1)  # a document never seen: cold
        eng.add_request(req)
        eng.run_until_done()
        cold.append(_ttft(req))
        eng.add_request(_request(f"seed{r}", docs[runs + r], 1))  # cache another document...
        eng.run_until_done()
        req = _request(f"warm{r}", docs[runs + r] + suffix, 1)  # ...then send it with the suffix
        eng.add_request(req)
        eng.run_until_done()
        warm.append(_ttft(req))
        assert req.num_cached_tokens == len(docs[runs + r]), req.num_cached_tokens
    c, w = statistics.median(cold), statistics.median(warm)
    return {"cold_ttft_s": round(c, 3), "warm_ttft_s": round(w, 3), "reduction_pct": round(100 * (w - c) / c, 1)}


def publication(args, prompts: list[list[int]], followers: int, policy: str) -> float:
    llm = _engine(args, prefix_publish=policy, single_flight="off")
    eng = llm.engine
    samples = []
    for r in range(args.runs):
        prompt = prompts[r]
        eng.add_request(_request(f"lead{r}", prompt, args.output_tokens))
        while eng.requests[f"lead{r}"].metrics.first_token_time is None:
            eng.step()
        reqs = [_request(f"f{r}.{i}", prompt, args.output_tokens) for i in range(followers)]
        for req in reqs:
            eng.add_request(req)
        while any(q.metrics.first_token_time is None for q in reqs):
            eng.step()
        samples.append(statistics.mean(_ttft(q) for q in reqs))
        for rid in list(eng.requests):
            eng.abort(rid)
    return statistics.median(samples)


def simultaneous(args, prompts: list[list[int]], n: int, mode: str) -> dict:
    overrides = {"enable_prefix_caching": False} if mode == "independent" else {"single_flight": mode}
    llm = _engine(args, **overrides)
    eng = llm.engine
    ttfts, slowest = [], []
    for r in range(args.runs):
        reqs = [_request(f"s{r}.{i}", prompts[r], args.output_tokens) for i in range(n)]
        t0 = time.monotonic()
        for req in reqs:
            eng.add_request(req)
        eng.run_until_done()
        ttfts.append(statistics.mean(_ttft(q) for q in reqs))
        slowest.append(max(q.metrics.finished_time for q in reqs) - t0)
    return {"mean_ttft_s": round(statistics.median(ttfts), 3), "slowest_s": round(statistics.median(slowest), 3)}


def main(args) -> int:
    report = {"benchmark": "prefix-cache", "model": args.model, "runs": args.runs, "command": " ".join(sys.argv)}
    llm = _engine(args)
    tok = llm.tokenizer
    # Distinct prompts per run, so that nothing is warm by accident.
    docs = make_prompts(tok, 2 * args.runs, 880, "document")
    suffix = make_prompts(tok, 1, 24, "question")[0]
    report["warm_reuse"] = warm_reuse(llm, docs, suffix, args.runs)
    print("warm reuse:", report["warm_reuse"], file=sys.stderr)
    del llm
    prompts = make_prompts(tok, args.runs, 532, "shared prompt")

    report["publication"] = []
    for n in args.sizes:
        row = {"followers": n}
        for policy in ("completion", "incremental"):
            row[f"{policy}_mean_ttft_s"] = round(publication(args, prompts, n, policy), 3)
        c, i = row["completion_mean_ttft_s"], row["incremental_mean_ttft_s"]
        row["reduction_pct"] = round(100 * (i - c) / c, 1)
        report["publication"].append(row)
        print("publication:", row, file=sys.stderr)

    report["simultaneous"] = []
    for n in args.sizes:
        row = {"requests": n}
        for mode in ("independent", "at-completion", "after-prefill"):
            row[mode] = simultaneous(args, prompts, n, mode)
        base = row["independent"]
        for mode in ("at-completion", "after-prefill"):
            row[mode]["ttft_vs_independent_pct"] = round(
                100 * (row[mode]["mean_ttft_s"] - base["mean_ttft_s"]) / base["mean_ttft_s"], 1)
            row[mode]["slowest_vs_independent_pct"] = round(
                100 * (row[mode]["slowest_s"] - base["slowest_s"]) / base["slowest_s"], 1)
        report["simultaneous"].append(row)
        print("simultaneous:", row, file=sys.stderr)

    w = report["warm_reuse"]
    print(f"\n1. warm reuse (904-token prompt): cold TTFT {w['cold_ttft_s']:.2f}s, warm {w['warm_ttft_s']:.2f}s "
          f"({w['reduction_pct']:+.1f}%)")
    print("\n2. publication: mean follower TTFT (s)")
    print(f"{'followers':>10}{'completion':>12}{'incremental':>13}{'change':>9}")
    for r in report["publication"]:
        print(f"{r['followers']:>10}{r['completion_mean_ttft_s']:>12.2f}{r['incremental_mean_ttft_s']:>13.2f}"
              f"{r['reduction_pct']:>8.1f}%")
    print("\n3. simultaneous identical requests: mean TTFT / slowest completion (s), change vs independent")
    for r in report["simultaneous"]:
        cells = [f"independent {r['independent']['mean_ttft_s']:.2f}/{r['independent']['slowest_s']:.2f}"]
        for mode in ("at-completion", "after-prefill"):
            m = r[mode]
            cells.append(f"{mode} {m['mean_ttft_s']:.2f}/{m['slowest_s']:.2f} "
                         f"({m['ttft_vs_independent_pct']:+.1f}% / {m['slowest_vs_independent_pct']:+.1f}%)")
        print(f"  N={r['requests']}: " + "; ".join(cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("prefix-cache", help="warm reuse, publication policy and single-flight TTFT")
    add_model_flag(p)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="followers / simultaneous requests")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None)
    add_engine_flags(p)
    p.set_defaults(func=main)
