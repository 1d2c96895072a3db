"""The web page's data: /v1/dashboard, the `hetserve` extension on answers, what needs the API key."""

from __future__ import annotations

import json

import httpx
from test_server import Server

KEY = {"Authorization": "Bearer secret"}


def test_dashboard_and_answer_stats_of_a_split_request(tiny_qwen2):
    s = Server(tiny_qwen2, "--inference-device", "cpu:threads=1", "--inference-device", "cpu:threads=1",
               "--kv-cache-memory", "8MiB", "--no-startup-profile", "--disaggregate", "prefill=cpu0,decode=cpu1",
               "--api-key", "secret")
    try:
        assert httpx.get(s.url + "/").status_code == 200  # the page and its files need no key...
        assert httpx.get(s.url + "/static/app.js").status_code == 200
        assert httpx.get(s.url + "/v1/dashboard").status_code == 401  # ...its data does
        body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=KEY, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
        assert final["hetserve"] == {"worker": "cpu1", "cached_tokens": 0, "spec": None,
                                     "disaggregated": {"prefill": "cpu0", "decode": "cpu1"}}
        plain = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False, "stream_options": None},
                           headers=KEY, timeout=60).json()
        assert plain["choices"][0]["hetserve"]["disaggregated"] == {"prefill": "cpu0", "decode": "cpu1"}

        d = httpx.get(s.url + "/v1/dashboard", headers=KEY, timeout=60).json()
        assert [w["name"] for w in d["workers"]] == ["cpu0", "cpu1"]
        assert all(w["state"] == "up" and w["kv_pages_total"] > 0 and w["profile"] for w in d["workers"])
        # Rates over the last 5 s (dashboard.RATE_S): the plain request's tokens came milliseconds ago
        assert d["workers"][0]["prefill_tok_s"] > 0 and d["workers"][1]["decode_tok_s"] > 0
        routed = [e for e in d["routes"] if "choice" in e]
        transfers = [e for e in d["routes"] if e.get("event") == "kv_transfer"]
        assert len(routed) == 2 and routed[0]["choice"] == "cpu0" and routed[0]["candidates"]
        assert len(transfers) == 2 and transfers[0]["ok"] and transfers[0]["decode"] == "cpu1"
        lat = d["latency"]
        # to 0.1 ms: a fast machine's inter-token gap can read 0
        assert lat["ttft"]["p50"] >= 0 and lat["itl"]["p99"] >= lat["itl"]["p50"] >= 0 and lat["series"]
    finally:
        assert s.stop() == 0
