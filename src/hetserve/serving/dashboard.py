"""What the web page's dashboard shows (`GET /v1/dashboard`), kept by the frontend as it serves.

Bounded rings: the last 50 routing decisions (the same objects --route-log writes), latency
samples of the last five minutes, and per worker the tokens of the last few seconds for its
decode and prefill rates. Worker state, profiles and counters come from the frontend as they are.
"""

from __future__ import annotations

import collections
import time

ROUTES = 50
WINDOW_S = 300.0  # latency percentiles and series over this long
BUCKET_S = 10.0  # one series point per this many seconds
RATE_S = 5.0  # tok/s over the last this many seconds
_MAX_SAMPLES = 20000


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    s = sorted(values)
    at = lambda q: round(s[min(len(s) - 1, int(q * len(s)))], 4)  # noqa: E731
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


class LiveStats:
    def __init__(self) -> None:
        self.routes: collections.deque[dict] = collections.deque(maxlen=ROUTES)
        self._ttft: collections.deque[tuple[float, float]] = collections.deque(maxlen=_MAX_SAMPLES)
        self._itl: collections.deque[tuple[float, float]] = collections.deque(maxlen=_MAX_SAMPLES)
        self._tokens: dict[str, collections.deque[tuple[float, int, int]]] = {}  # (time, decode, prefill)

    def route(self, entry: dict) -> None:
        self.routes.appendleft(entry)

    def ttft(self, seconds: float) -> None:
        self._ttft.append((time.time(), seconds))

    def itl(self, seconds: float) -> None:
        self._itl.append((time.time(), seconds))

    def tokens(self, worker: str, decode: int = 0, prefill: int = 0) -> None:
        ring = self._tokens.setdefault(worker, collections.deque(maxlen=_MAX_SAMPLES))
        ring.append((time.monotonic(), decode, prefill))

    def rates(self, worker: str) -> tuple[float, float]:
        """(decode, prefill) tokens per second over the last RATE_S seconds."""
        ring = self._tokens.get(worker, ())
        since = time.monotonic() - RATE_S
        recent = [x for x in ring if x[0] >= since]
        return (round(sum(x[1] for x in recent) / RATE_S, 2), round(sum(x[2] for x in recent) / RATE_S, 2))

    def latency(self) -> dict:
        now = time.time()
        ttft = [(t, v) for t, v in self._ttft if t >= now - WINDOW_S]
        itl = [(t, v) for t, v in self._itl if t >= now - WINDOW_S]
        buckets: dict[float, tuple[list, list]] = collections.defaultdict(lambda: ([], []))
        for t, v in ttft:
            buckets[t - t % BUCKET_S][0].append(v)
        for t, v in itl:
            buckets[t - t % BUCKET_S][1].append(v)
        series = []
        for t in sorted(buckets):
            a, b = _percentiles(buckets[t][0]), _percentiles(buckets[t][1])
            series.append({"t": t, "ttft_p50": a["p50"], "ttft_p99": a["p99"], "itl_p50": b["p50"],
                           "itl_p99": b["p99"]})
        return {"window_s": WINDOW_S, "ttft": _percentiles([v for _, v in ttft]),
                "itl": _percentiles([v for _, v in itl]), "series": series}


def dashboard(fe) -> dict:
    """The /v1/dashboard body (fields listed in docs/server.md, "Web page")."""
    profiles = fe.worker_profiles()
    workers = []
    for w, h in zip(fe.workers, fe.health()["workers"]):
        s = w.state if w.alive else None
        prefix = dict(s.prefix_cache) if s else {}
        if prefix.get("lookups"):
            prefix["hit_rate"] = round(prefix.get("hits", 0) / prefix["lookups"], 4)
        else:
            prefix["hit_rate"] = None
        spec = None
        if s and s.spec_decode.get("rounds"):
            spec = {"acceptance_rate": s.spec_decode.get("acceptance_rate", 0.0),
                    "mean_k": round(s.spec_decode.get("proposed", 0) / s.spec_decode["rounds"], 3),
                    "proposed": s.spec_decode.get("proposed", 0), "accepted": s.spec_decode.get("accepted", 0)}
        decode, prefill = fe.live.rates(w.name) if w.alive else (0.0, 0.0)
        workers.append({**h, "preemptions": s.preemptions if s else 0, "prefix_cache": prefix,
                        "decode_tok_s": decode, "prefill_tok_s": prefill, "spec": spec,
                        "profile": profiles.get(w.name)})
    return {"model": fe.model_name, "time": time.time(), "route_policy": fe.route_policy, "workers": workers,
            "routes": list(fe.live.routes), "latency": fe.live.latency()}
