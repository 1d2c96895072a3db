"""`hetserve bench serve`: a load client for a running server, in the manner of `vllm bench serve`.

Sends --num-prompts streaming completions of exactly --input-tokens prompt tokens (token
ids, so no tokenizer is needed here; EOS ignored, --output-tokens each) with at most
--max-concurrency in flight, arriving as a Poisson process at --request-rate per second
(inf: all at once). Reports TTFT, TPOT, ITL and E2E (mean, median, p99, max), request and
output throughput and the failed count; --out writes JSON. ITL's max beside its p99: a server
that stalls a few streams for long (a big prefill batch) and one that stalls many briefly can
share a p99.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time


def _summary(values: list[float]) -> dict:
    """Seconds to the microsecond: a fast server's tokens can arrive well under 0.1 ms apart (and
    several in one read, 0 apart), which coarser rounding would report as 0."""
    if not values:
        return {"mean": None, "median": None, "p99": None, "max": None}
    s = sorted(values)
    return {"mean": round(statistics.mean(s), 6), "median": round(statistics.median(s), 6),
            "p99": round(s[min(len(s) - 1, int(0.99 * len(s)))], 6), "max": round(s[-1], 6)}


async def _one(client, url: str, prompt: list[int], args, headers, max_tokens: int | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens or args.output_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if args.model:
        body["model"] = args.model
    t0 = time.perf_counter()
    times, usage, error = [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    error = data["error"]["message"]
                    continue
                if data.get("usage"):
                    usage = data["usage"]
                if any(c.get("text") for c in data.get("choices", [])):
                    times.append(time.perf_counter())
    except Exception as e:  # a failed request is counted, not fatal to the run
        return {"ok": False, "error": repr(e)}
    end = time.perf_counter()
    if error or usage is None or not times:
        return {"ok": False, "error": error or "no output"}
    n = usage["completion_tokens"]
    return {"ok": True, "ttft": times[0] - t0, "e2e": end - t0, "itl": [b - a for a, b in zip(times, times[1:])],
            "tpot": (end - times[0]) / (n - 1) if n > 1 else None, "output_tokens": n,
            "prompt_tokens": usage["prompt_tokens"]}


async def _run(args) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=1000)) as c:
        async def tokenize(text: str) -> list[int]:
            # hetserve and vLLM read `prompt`, llama.cpp's server `content`: the same bench drives all.
            r = await c.post(args.url + "/tokenize", json={"prompt": text, "content": text}, headers=headers)
            return r.json()["tokens"]

        body = await tokenize("def merge_sort(items):\n    if len(items) <= 1:\n        return items\n" * 8)
        body = body * (args.input_tokens // len(body) + 2)
        # A distinct head per prompt (and per run) so that no prompt shares a KV page with another:
        # this measures serving, not prefix-cache hits.
        nonce = random.Random().getrandbits(32)
        prompts = [((await tokenize(f"# request {nonce}-{i}\n")) + body)[: args.input_tokens]
                   for i in range(args.num_prompts)]
        sem = asyncio.Semaphore(args.max_concurrency)
        rng = random.Random(args.seed)

        async def limited(p):
            async with sem:
                return await _one(c, args.url, p, args, headers)

        long_task = None
        if args.long_prompt_tokens:  # one long prompt arriving beside the streams (a coding agent's turn)
            long_prompt = ((await tokenize(f"# long request {nonce}\n")) + body * (args.long_prompt_tokens // len(body) + 1))
            long_prompt = long_prompt[: args.long_prompt_tokens]

            async def late_long():
                await asyncio.sleep(args.long_prompt_after)
                return await _one(c, args.url, long_prompt, args, headers, max_tokens=1)

            long_task = asyncio.ensure_future(late_long())
        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.ensure_future(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        long_result = await long_task if long_task is not None else None
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    return {
        "benchmark": "serve", "url": args.url, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate, "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
        "duration_s": round(duration, 2), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "request_throughput": round(len(ok) / duration, 4), "output_throughput": round(out_tokens / duration, 2),
        "total_input_tokens": prompt_tokens, "total_output_tokens": out_tokens,
        "total_token_throughput": round((out_tokens + prompt_tokens) / duration, 2),
        "ttft_s": _summary([r["ttft"] for r in ok]), "tpot_s": _summary([r["tpot"] for r in ok if r["tpot"]]),
        "itl_s": _summary([x for r in ok for x in r["itl"]]), "e2e_s": _summary([r["e2e"] for r in ok]),
        "long_prompt": None if long_result is None else {
            "tokens": args.long_prompt_tokens, "after_s": args.long_prompt_after, "ok": long_result["ok"],
            "ttft_s": round(long_result["ttft"], 3) if long_result["ok"] else None},
        "command": " ".join(sys.argv),
    }


def main(args) -> int:
    report = asyncio.run(_run(args))
    print(f"requests: {report['completed']} completed, {report['failed']} failed in {report['duration_s']:.1f}s")
    print(f"throughput: {report['request_throughput']:.3f} req/s, {report['output_throughput']:.2f} output tok/s, "
          f"{report['total_token_throughput']:.2f} total tok/s")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        v = report[key]
        if v["mean"] is not None:
            print(f"{key[:-2].upper():>5} mean {1e3 * v['mean']:.2f} ms  median {1e3 * v['median']:.2f} ms  "
                  f"p99 {1e3 * v['p99']:.2f} ms  max {1e3 * v['max']:.2f} ms")
    if report["long_prompt"]:
        lp = report["long_prompt"]
        ttft = "failed" if lp["ttft_s"] is None else f"{lp['ttft_s']:.2f} s"
        print(f"long prompt: {lp['tokens']} tokens {lp['after_s']} s in, TTFT {ttft}")
    if report["errors"]:
        print("errors:", report["errors"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 else 1


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load a running server like `vllm bench serve`")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: none)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson)")
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-prompt-tokens", type=int, default=0,
                   help="also send one prompt of N tokens (max_tokens 1) --long-prompt-after seconds in: the streams' "
                        "ITL max then shows how long its prefill stalled them")
    p.add_argument("--long-prompt-after", type=float, default=2.0)
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
