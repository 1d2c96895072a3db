"""A seeded fuzz of field types and values on the OpenAI routes: never a 5xx, the server stays healthy."""

from __future__ import annotations

import json
import random

import httpx
from test_server import Server

VALUES = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**70), 0.5, -1e308, 1e999, "x", "", "\ud800",
          "<|im_start|>", [], [1], [-1], [2**64], ["a"], [[1, 2]], {}, {"a": 1}, {"1": 2**70}]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "n", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo", "logit_bias", "stream",
          "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "ignore_eos", "prompt_logprobs", "parse_special", "cache_salt", "worker", "user", "model",
          "response_format", "tools", "skip_special_tokens", "add_generation_prompt", "input", "instructions",
          "max_output_tokens", "previous_response_id", "store", "tool_choice", "structured_outputs", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar", "grammar", "json_schema", "parallel_tool_calls"]


def body(rng: random.Random, route: str) -> str:
    b = {"prompt": "hi", "max_tokens": 2} if route == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if route == "/v1/chat/completions" else \
        {"input": "hi", "max_output_tokens": 2}
    for name in rng.sample(FIELDS, rng.randint(1, 4)):
        b[name] = rng.choice(VALUES)
    if b.get("stream"):  # a stream would answer 200 and report errors in-band
        b["stream"] = False
    return json.dumps(b, allow_nan=True)


def test_fuzzed_fields_never_get_a_5xx(tiny_qwen2):
    s = Server(tiny_qwen2, "--kv-cache-memory", "8MiB")
    rng = random.Random(1234)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for _ in range(200):
                route = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"])
                data = body(rng, route)
                r = c.post(route, content=data, headers={"content-type": "application/json"})
                assert r.status_code < 500, (route, data, r.text)
                assert "Traceback" not in r.text
                if r.status_code >= 400:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            ok = c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
            assert ok.status_code == 200 and c.get("/health").json()["status"] == "ok"
        assert s.metric("hetserve:num_requests_running") == 0 and s.metric("hetserve:kv_pages_used") == 0
    finally:
        assert s.stop() == 0
