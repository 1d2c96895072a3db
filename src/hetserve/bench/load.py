"""`hetserve bench load`: many streaming clients that misbehave, against a running server.

--clients clients each send streaming completions back to back for --duration seconds. Each
request is, at random, abandoned before its answer (--abort: the client cancels within half a
second of sending), dropped mid-stream (--disconnect: the connection is closed after a random
number of tokens) or read to its end. Every request read to its end must finish with a full
answer or an error event; one that does neither is "lost". Afterwards the server's /metrics must
show running and waiting requests and referenced KV pages back at 0 on every worker.

Bounded by construction: loopback URLs only, at most 256 clients and 600 s.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import sys
import time
from urllib.parse import urlparse

from .serve import _summary

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_GAUGES = ("hetserve:num_requests_running", "hetserve:num_requests_waiting", "hetserve:kv_pages_used")


async def _gauges(c, url: str, headers: dict) -> dict[str, float]:
    text = (await c.get(url + "/metrics", headers=headers)).text
    return {g: sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(g)}\{{[^}}]*\}} (\S+)$", text, re.M))
            for g in _GAUGES}


async def _request(c, url: str, body: dict, headers: dict, fate: str, rng: random.Random) -> dict:
    """One request; returns its outcome: kind (full, error, lost, aborted, disconnected) and timings."""
    t0 = time.perf_counter()
    cut = rng.randint(1, max(1, body["max_tokens"] - 1)) if fate == "disconnect" else None
    times, finished, error = [], False, None
    async with c.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"kind": "error", "error": f"HTTP {r.status_code}"}
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"]["message"]
                continue
            for ch in data.get("choices", []):
                if ch.get("text"):
                    times.append(time.perf_counter())
                finished = finished or ch.get("finish_reason") is not None
            if cut is not None and len(times) >= cut:
                return {"kind": "disconnected"}  # leaving the block closes the connection mid-stream
    if error is not None:
        return {"kind": "error", "error": re.sub(r"\d+", "N", error)[:80]}
    if not (done and finished and times):
        return {"kind": "lost"}
    return {"kind": "full", "ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])]}


async def _run(args) -> dict:
    import httpx

    if urlparse(args.url).hostname not in _LOOPBACK:
        raise SystemExit("bench load drives loopback servers only (--url http://127.0.0.1:PORT)")
    clients, duration = min(args.clients, 256), min(args.duration, 600.0)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as c:
        r = await c.post(args.url + "/tokenize", json={"prompt": "def merge_sort(items):\n    return items\n" * 32},
                         headers=headers)
        text_ids = r.json()["tokens"]
        outcomes: list[dict] = []
        deadline = time.monotonic() + duration

        async def client(k: int) -> None:
            rng = random.Random(args.seed * 1000 + k)
            n = 0
            while time.monotonic() < deadline:
                n += 1
                # A shared head on some requests (prefix-cache hits), a distinct one on the rest.
                head = [] if rng.random() < 0.3 else [rng.choice(text_ids) for _ in range(6)]
                prompt = (head + text_ids * 8)[: rng.randint(args.prompt_tokens // 2, args.prompt_tokens)]
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
                        "temperature": rng.choice([0.0, 0.8])}
                u = rng.random()
                fate = "abort" if u < args.abort else "disconnect" if u < args.abort + args.disconnect else "full"
                task = asyncio.ensure_future(_request(c, args.url, body, headers, fate, rng))
                if fate == "abort":
                    await asyncio.sleep(rng.uniform(0.0, 0.5))
                    if not task.done():
                        task.cancel()
                        outcomes.append({"kind": "aborted"})
                        await asyncio.gather(task, return_exceptions=True)
                        continue
                try:
                    outcomes.append(await task)
                except Exception as e:  # a transport failure is counted, not fatal to the run
                    outcomes.append({"kind": "error", "error": type(e).__name__})

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(clients)))
        elapsed = time.perf_counter() - t0
        settle = time.monotonic() + 30  # aborted work leaves within a step; give stragglers time
        while True:
            after = await _gauges(c, args.url, headers)
            if not any(after.values()) or time.monotonic() > settle:
                break
            await asyncio.sleep(0.2)
    kinds = collections.Counter(o["kind"] for o in outcomes)
    full = [o for o in outcomes if o["kind"] == "full"]
    return {
        "benchmark": "load", "url": args.url, "clients": clients, "duration_s": round(elapsed, 1),
        "abort": args.abort, "disconnect": args.disconnect, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "requests": len(outcomes), "outcomes": dict(kinds),
        "errors": dict(collections.Counter(o["error"] for o in outcomes if o["kind"] == "error")),
        "ttft_s": _summary([o["ttft"] for o in full]), "itl_s": _summary([x for o in full for x in o["itl"]]),
        "after": after, "command": " ".join(sys.argv),
    }


def main(args) -> int:
    report = asyncio.run(_run(args))
    o = report["outcomes"]
    print(f"{report['requests']} requests from {report['clients']} clients in {report['duration_s']} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(o.items())))
    if report["errors"]:
        print("errors:", report["errors"])
    for key in ("ttft_s", "itl_s"):
        v = report[key]
        if v["median"] is not None:
            print(f"{key[:-2].upper():>4} p50 {v['median']:.3f}s  p99 {v['p99']:.3f}s")
    print("after the run: " + ", ".join(f"{k.split(':')[1]} {v:g}" for k, v in report["after"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if not o.get("lost") and not any(report["after"].values()) else 1


def add_parser(sub) -> None:
    p = sub.add_parser("load", help="misbehaving streaming clients against a running server; nothing may be lost")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a loopback server")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (at most 256)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds (at most 600)")
    p.add_argument("--disconnect", type=float, default=0.2, help="share of requests dropped mid-stream")
    p.add_argument("--abort", type=float, default=0.05, help="share of requests abandoned before their answer")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompts of half this to this many tokens")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
