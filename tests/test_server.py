"""`hetserve serve` end to end: the official openai client, bad input, concurrency, lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(proc: subprocess.Popen) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def worker_pids(proc: subprocess.Popen) -> list[int]:
    def is_worker(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"hetserve.serving.worker" in f.read()
        except FileNotFoundError:  # ended since pgrep saw it
            return False
    return [p for p in child_pids(proc) if is_worker(p)]


class Server:
    def __init__(self, model: str, *flags: str, timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "hetserve.cli", "serve", "--model", model,
                                      "--port", str(self.port), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not become healthy")
            time.sleep(0.2)

    def child_pids(self) -> list[int]:
        """Every child process: the workers and the tokenizer processes."""
        return child_pids(self.proc)

    def worker_pids(self) -> list[int]:
        return worker_pids(self.proc)

    def metric(self, name: str, headers=None) -> float:
        """A metric summed over its labels (`hetserve:worker_up`), or one series
        (`hetserve:worker_up{worker="cpu1"}`, labels as the server writes them)."""
        text = httpx.get(self.url + "/metrics", headers=headers or {}, timeout=60).text
        labels = "" if "{" in name else r"\{[^}]*\}"
        vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{labels} (\S+)$", text, re.M)]
        assert vals or "{" not in name, f"no series {name} in /metrics"
        return sum(vals)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)  # only an upper bound: a drain keeps --shutdown-timeout (30 s by default)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = Server(tiny_qwen2, "--kv-cache-memory", "16MiB", "--max-num-seqs", "16")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def model_id(client) -> str:
    return client.models.list().data[0].id


def test_models_and_health(server, client):
    assert model_id(client) == "tiny-qwen2.gguf"
    assert httpx.get(server.url + "/health").status_code == 200


def test_bench_serve_measures_the_server(server, tmp_path):
    """`hetserve bench serve` against a live server: every request served with exactly the tokens
    asked for, and its summaries ordered (median <= p99 <= max). Only what holds at any speed:
    a request takes some time, but two tokens can arrive in one read (an ITL of 0)."""
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, "-m", "hetserve.cli", "bench", "serve", "--url", server.url,
                        "--num-prompts", "4", "--max-concurrency", "2", "--input-tokens", "40",
                        "--output-tokens", "6", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert (rep["completed"], rep["failed"]) == (4, 0)
    assert (rep["total_input_tokens"], rep["total_output_tokens"]) == (4 * 40, 4 * 6)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        v = rep[key]
        assert 0 <= v["median"] <= v["p99"] <= v["max"] and 0 <= v["mean"] <= v["max"], (key, v)
    assert 0 < rep["ttft_s"]["max"] <= rep["e2e_s"]["max"]
    assert rep["itl_s"]["max"] <= rep["e2e_s"]["max"] and rep["tpot_s"]["max"] <= rep["e2e_s"]["max"]
    assert "ITL mean" in r.stdout and "max" in r.stdout


def test_completions_sync(client):
    r = client.completions.create(model=model_id(client), prompt="def add(a, b):", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    again = client.completions.create(model=model_id(client), prompt="def add(a, b):", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text
    assert again.usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_sync_with_n_seed_logprobs(client):
    kw = dict(model=model_id(client), messages=[{"role": "user", "content": "hello"}], max_tokens=6,
              temperature=0.8, seed=5, n=2, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 12
    for c in r.choices:
        assert c.message.role == "assistant" and len(c.logprobs.content) == 6
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == \
        [c.message.content for c in r.choices]


def test_streaming_sync(client):
    chunks = list(client.completions.create(model=model_id(client), prompt="hello", max_tokens=10, stream=True,
                                            temperature=0, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"
    chat = list(client.chat.completions.create(model=model_id(client), messages=[{"role": "user", "content": "x"}],
                                               max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason == "length"


def test_async_client_stream_and_not(server):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        mid = (await c.models.list()).data[0].id
        r = await c.chat.completions.create(model=mid, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            extra_body={"ignore_eos": True})
        text = []
        stream = await c.completions.create(model=mid, prompt="abc", max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True})
        async for ch in stream:
            text += [x.text for x in ch.choices]
        return r, text

    r, text = asyncio.run(main())
    assert r.usage.completion_tokens == 4 and len(text) >= 1


def test_stop_string_and_cached_tokens(client):
    mid = model_id(client)
    base = client.completions.create(model=mid, prompt="The quick brown fox " * 4, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[4:7]
    r = client.completions.create(model=mid, prompt="The quick brown fox " * 4, max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: restored pages


def _deep(n: int) -> dict:
    """A schema nesting n levels of properties."""
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"items": schema}


BAD = [
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": 2}', 400, "top_p"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 100000}', 400, "exceeds the model's context of 512"),
    ("/v1/completions", '{"prompt": "x", "logprobs": 50}', 400, "logprobs"),
    ("/v1/completions", '{"prompt": "x", "n": 100}', 400, "n"),
    ("/v1/completions", '{"prompt": "x", "n": 0}', 400, "n"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": ["s"] * 40}), 400, "stop"),
    ("/v1/completions", '{"prompt": [1, 2, 999999]}', 400, "outside the vocabulary"),
    ("/v1/completions", '{"prompt": ""}', 400, "empty"),
    ("/v1/completions", '{"prompt": {"a": 1}}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "x", "model": "gpt-9"}', 404, "does not exist"),
    ("/v1/completions", '{not json', 400, "invalid"),
    # Integers that would overflow the worker messages' 64-bit fields (were 500s).
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}', 400, "seed"),
    ("/v1/completions", '{"prompt": "hi", "top_k": 1180591620717411303424}', 400, "top_k"),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [18446744073709551616]}', 400, "stop_token_ids"),
    # Lone surrogates are valid JSON, not text (were 500s).
    ("/v1/completions", '{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "surrogate"),
    ("/tokenize", '{"prompt": "\\udfff"}', 400, "surrogate"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', 400, "surrogate"),
    # Unusable output constraints: a 400 naming the field, before anything is queued.
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
     '"response_format": {"type": "xml"}}', 400, "response_format"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
     '"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}', 400, "response_format"),
    ("/v1/completions", '{"prompt": "x", "guided_json": {"type": "bogus"}}', 400, "guided_json"),
    ("/v1/completions", '{"prompt": "x", "guided_regex": "[a"}', 400, "guided_regex"),
    ("/v1/completions", '{"prompt": "x", "grammar": "root ::= missing"}', 400, "grammar"),
    ("/v1/completions", '{"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}', 400,
     "exactly one"),
    ("/v1/completions", '{"prompt": "x", "guided_choice": []}', 400, "guided_choice"),
    ("/v1/completions", '{"prompt": "x", "guided_regex": "a", "json_schema": {}}', 400, "both constrain"),
    ("/v1/completions", json.dumps({"prompt": "x", "json_schema": {"type": "array", "items": None} | _deep(40)}),
     400, "deeper than 32"),
    ("/v1/completions", json.dumps({"prompt": "x", "guided_regex": "a" * 300_000}), 400, "at most"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     '"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}', 400,
     "tool_choice"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', 400,
     "tool_choice"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     '"function": {"name": "bad name!"}}]}', 400, "tools"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}', 400,
     "functions"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"999999": 1}}', 400, "outside the vocabulary"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": 101}}', 400, "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"five": 1}}', 400, "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 0}', 400, "echo"),
    # OpenAI's and vLLM's 400s where pydantic says 422.
    ("/v1/chat/completions", '{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"content": "x"}]}', 400, "role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
     '"stream_options": {"include_usage": true}}', 400, "stream_options"),
    ("/v1/chat/completions", '{"messages": []}', 400, "empty"),
    # Refused while parsing, before any template work (10**5 messages stalled the server).
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}] * 100000}), 400,
     "at most 2048"),
    ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
    ("/v1/nothing", '{}', 404, "Not Found"),
    ("/detokenize", '{"tokens": [-1]}', 400, "outside the vocabulary"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD)
def test_bad_input_gets_openai_error(server, client, path, body, status, needle):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"] + str(err["param"])
    assert "Traceback" not in r.text and ".py" not in r.text and "/work" not in r.text
    ok = client.completions.create(model=model_id(client), prompt="fine", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_body_too_large(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_tokenize_roundtrip(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "def add(a, b):"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "def add(a, b):"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > ids["count"] - 5


def test_32_concurrent_streams_complete(server):
    async def one(c, mid, i):
        n = 0
        stream = await c.completions.create(model=mid, prompt=f"request {i}", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for ch in stream:
            usage = ch.usage or usage
            n += sum(1 for _ in ch.choices)
        return usage.completion_tokens

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        mid = (await c.models.list()).data[0].id
        return await asyncio.gather(*[one(c, mid, i) for i in range(32)])

    assert asyncio.run(main()) == [12] * 32


def test_disconnecting_clients_free_their_pages(server):
    async def one(client, i):
        body = {"prompt": f"disconnect {i} " * 10, "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return  # leave after the first chunk

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*[one(client, i) for i in range(16)])

    asyncio.run(main())
    deadline = time.monotonic() + 60  # only an upper bound: the aborts land within a step or two
    while server.metric("hetserve:kv_pages_used") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("hetserve:kv_pages_used") == 0
    assert server.metric("hetserve:num_requests_running") == 0
    assert server.metric("hetserve:kv_pages_total") > 0
    # What prefills in --max-decode-stall, measured: between the pacer's floor and cap whatever the machine's speed
    assert 64 <= server.metric("hetserve:prefill_chunk_budget") <= 512
    assert server.metric("hetserve:time_to_first_token_seconds_count") > 0


def test_api_key(tiny_qwen2):
    s = Server(tiny_qwen2, "--api-key", "sekret", "--kv-cache-memory", "8MiB")
    try:
        assert httpx.get(s.url + "/health").status_code == 200  # health stays open
        for path in ("/", "/static/favicon.svg", "/favicon.ico"):  # the page and its icon hold no data
            page = httpx.get(s.url + path)
            assert page.status_code == 200 and page.content, path
        assert page.headers["content-type"] == "image/svg+xml" and page.content.startswith(b"<svg")
        r = httpx.get(s.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(s.url + "/metrics", headers={"Host": "localhost"}).status_code == 401
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret")
        assert c.completions.create(model=model_id(c), prompt="x", max_tokens=2).usage.completion_tokens >= 1
    finally:
        assert s.stop() == 0


def test_queue_cap_answers_503(tiny_qwen2):
    s = Server(tiny_qwen2, "--max-queued-requests", "1", "--max-num-seqs", "1", "--kv-cache-memory", "8MiB")
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": "q " * 200, "max_tokens": 100, "ignore_eos": True}
                return await asyncio.gather(*[c.post(s.url + "/v1/completions", json=body) for _ in range(6)])

        codes = sorted(r.status_code for r in asyncio.run(main()))
        assert 503 in codes and 200 in codes
    finally:
        assert s.stop() == 0


def test_sigterm_drains_and_exits_cleanly(tiny_qwen2):
    s = Server(tiny_qwen2, "--shutdown-timeout", "1", "--kv-cache-memory", "8MiB")
    workers = s.child_pids()
    assert workers
    lines: list[str] = []

    async def stream():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"prompt": "long", "max_tokens": 500, "stream": True, "ignore_eos": True}
            async with c.stream("POST", s.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        if len(lines) == 2:
                            s.proc.send_signal(signal.SIGTERM)

    asyncio.run(stream())
    assert s.proc.wait(120) == 0
    assert any('"error"' in line for line in lines) or lines[-1] == "data: [DONE]"
    deadline = time.monotonic() + 60  # reaped by init once their parent is gone: poll, not a fixed wait
    while any(os.path.exists(f"/proc/{p}") for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(not os.path.exists(f"/proc/{p}") for p in workers), "worker process left behind"


def worker_pid(server: Server, name: str) -> int:
    for pid in server.worker_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            spec = json.loads(f.read().split(b"\0")[3])
        if spec["name"] == name:
            return pid
    raise LookupError(name)


async def kill_when_running(client: httpx.AsyncClient, server: Server, worker: str) -> None:
    """SIGKILL `worker` mid-request: once /metrics shows it running a request (polled, however long
    a slow host takes to get there; 60 s only catches a request that never shows)."""
    running = f'hetserve:num_requests_running{{worker="{worker}"}} 1.0'
    deadline = time.monotonic() + 60
    while running not in (await client.get(server.url + "/metrics")).text:
        assert time.monotonic() < deadline, f"{worker} never showed a running request"
        await asyncio.sleep(0.005)
    os.kill(worker_pid(server, worker), signal.SIGKILL)


def test_worker_death_fails_requests_and_health(tiny_qwen2):
    s = Server(tiny_qwen2, "--kv-cache-memory", "8MiB", "--worker-restarts", "0")
    try:
        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "long", "max_tokens": 500, "ignore_eos": True}
                task = asyncio.ensure_future(c.post(s.url + "/v1/completions", json=body))
                await kill_when_running(c, s, "cpu")  # a lone worker is named by its kind
                t = time.monotonic()
                r = await task
                return r, time.monotonic() - t

        r, waited = asyncio.run(main())
        # "died": its exit seen (a 0.1 s poll), not the heartbeat deadline ("stopped responding", 15 s);
        # the bound only catches a request left hanging (a correct server answers in well under a second)
        assert r.status_code == 503 and "died" in r.json()["error"]["message"]
        assert waited < 60
        assert httpx.get(s.url + "/health").status_code == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503
    finally:
        s.stop()


@pytest.mark.real_model
def test_real_model_end_to_end(real_05b, reference):
    s = Server(real_05b, "--kv-cache-memory", "256MiB")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        case = reference["cases"][-1]  # a rendered chat prompt, greedy tokens from HF transformers
        r = c.completions.create(model=model_id(c), prompt=case["prompt_token_ids"], max_tokens=32, temperature=0,
                                 extra_body={"ignore_eos": True, "skip_special_tokens": False})
        expected = httpx.post(s.url + "/detokenize", json={"tokens": case["greedy_token_ids"]}).json()["prompt"]
        assert r.usage.completion_tokens == 32
        assert r.choices[0].text == expected
        chat = c.chat.completions.create(model=model_id(c), messages=case["chat"], max_tokens=32, temperature=0)
        assert chat.choices[0].message.content.startswith(r.choices[0].text[:20])
    finally:
        assert s.stop() == 0


def test_serve_writes_a_trace_per_worker(tiny_qwen2, tmp_path):
    s = Server(tiny_qwen2, "--kv-cache-memory", "8MiB", "--trace-directory", str(tmp_path))
    worker = s.worker_pids()[0]
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        c.completions.create(model=model_id(c), prompt="trace me", max_tokens=3)
    finally:
        assert s.stop() == 0
    path = tmp_path / f"trace-cpu-{worker}.json"
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["name"] for e in events}
    # the decode steps' layers run in one native call: one `layers` span each
    assert {"step", "forward", "layers", "matmul", "queued", "finished"} <= names
