"""Several CPU workers behind the router, end to end: outputs, placement, cached prefixes, a dead worker."""

from __future__ import annotations

import contextlib
import asyncio
import json
import subprocess
import sys

import httpx
import torch
import pytest

from hetserve import LLM, SamplingParams
from test_server import Server, kill_when_running

PREFIX = [(7 * i) % 390 + 1 for i in range(96)]  # 6 pages of 16


def complete(url: str, prompt, max_tokens: int, **extra) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def routed(log_path) -> list[dict]:
    with open(log_path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def profile_file(tiny_qwen2, tmp_path_factory) -> str:
    """`hetserve profile` on the tiny model, used by the servers below instead of start-up profiles."""
    out = tmp_path_factory.mktemp("profile") / "cpu1.json"
    r = subprocess.run([sys.executable, "-m", "hetserve.cli", "profile", "--model", tiny_qwen2, "--inference-device",
                        "cpu:threads=1", "--kv-cache-memory", "16MiB", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())
    assert prof["device"] == "cpu:threads=1" and prof["format"] == "hetserve-profile-v1"
    # the points a worker measures at start-up, each the median of rounds whose spread is reported
    assert [n for n, _ in prof["prefill"]] == [32, 128] and [b for b, _ in prof["decode"]] == [1, 4]
    assert all(rate > 0 for _, rate in prof["prefill"] + prof["decode"])
    assert 3 <= prof["rounds"] <= 6 and prof["spread"]["worst"] >= 0
    assert [n for n, _ in prof["spread"]["prefill"]] == [32, 128]
    return str(out)


@contextlib.contextmanager
def one_thread():
    """Run in-process engines on one torch thread, as `cpu:threads=1` workers do: attention's
    reductions split by thread, and int8/int4 activation rounding can turn those last-bit
    differences into different tokens on a random tiny model."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tiny_qwen2, profile_file, tmp_path_factory):
    """Two deterministic CPU workers, cost routing, a route log. Both get the same profile (each
    matched by its --inference-device value), so their speeds are equal by construction: profiles
    measured at start-up on a busy 2-core machine would make the routing depend on the load.
    Start-up profiling is covered by test_llm_with_several_devices_routes_in_worker_processes, and
    profiles refined from the workers' steps (off here) by test_profile_refine.py."""
    log = tmp_path_factory.mktemp("route") / "route.jsonl"
    prof = json.load(open(profile_file))
    second = tmp_path_factory.mktemp("profile2") / "cpu1.json"
    second.write_text(json.dumps({**prof, "device": "cpu:threads=1,max_num_seqs=8"}))
    s = Server(tiny_qwen2, "--kv-cache-memory", "16MiB", "--deterministic", "--inference-device", "cpu:threads=1",
               "--inference-device", "cpu:threads=1,max_num_seqs=8", "--profile", profile_file,
               "--profile", str(second), "--route-log", str(log), "--worker-restarts", "0", "--profile-refine", "off")
    s.log = log
    yield s
    assert s.stop() == 0
    out = s.proc.stdout.read()
    n, given = json.load(open(profile_file))["prefill"][0]
    assert f"worker cpu0 (cpu:threads=1): prefill tok/s {{{n}: {given:.1f}," in out
    assert f"worker cpu1 (cpu:threads=1,max_num_seqs=8): prefill tok/s {{{n}: {given:.1f}," in out


def one_worker_outputs(model: str, prompts, params) -> list:
    """What one in-process deterministic engine generates, on one thread as the workers run
    (deterministic mode is invariant to batching, not to thread count)."""
    with one_thread():
        return LLM(model=model, kv_cache_memory="16MiB", deterministic=True).generate(prompts, params, use_tqdm=False)


def concurrent_completions(url: str, prompts, **extra) -> list[dict]:
    """Every prompt at once as a greedy 12-token completion; each must answer 200."""
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            async def one_request(p):
                r = await c.post(url + "/v1/completions", json={
                    "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra})
                assert r.status_code == 200, r.text
                return r.json()
            return await asyncio.gather(*[one_request(p) for p in prompts])
    return asyncio.run(main())


def test_two_workers_give_one_workers_outputs_and_share_the_work(tiny_qwen2, pair):
    prompts = [[(11 * i + 3 * k) % 390 + 1 for k in range(20 + 9 * i)] for i in range(6)]
    expected = one_worker_outputs(tiny_qwen2, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    results = concurrent_completions(pair.url, prompts, logprobs=1)
    assert [r["choices"][0]["text"] for r in results] == [o.text for o in expected]
    lines = routed(pair.log)
    assert len(lines) == 6 and all(line["policy"] == "cost" for line in lines)
    assert all([c["worker"] for c in line["candidates"]] == ["cpu0", "cpu1"] for line in lines)
    for line in lines:  # the lowest logged score wins (the first worker on a tie)
        assert line["choice"] == min(line["candidates"], key=lambda c: c["score"])["worker"]
    assert {line["choice"] for line in lines} == {"cpu0", "cpu1"}  # equal speeds: the work is shared


def test_a_cached_prefix_draws_the_request(pair):
    # The pages' hashes come with the state message that also carries the seed's last token.
    complete(pair.url, PREFIX + [1, 2, 3], 2, worker="cpu1")
    r = complete(pair.url, PREFIX + [4, 5, 6, 7], 4)
    last = routed(pair.log)[-1]
    assert last["choice"] == "cpu1"
    assert {c["worker"]: c["cached_tokens"] for c in last["candidates"]} == {"cpu0": 0, "cpu1": 96}
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    bad = httpx.post(pair.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "worker": "gpu7"})
    assert bad.status_code == 400 and "no worker named" in bad.json()["error"]["message"]


def test_the_route_log_says_how_a_decode_was_priced(pair):
    """With max_tokens, the decode is priced at it; without, at the mean output of the requests
    this server finished (never at the whole context left)."""
    complete(pair.url, [3, 4, 5], 5)
    given = routed(pair.log)[-1]
    assert given["decode_estimate"] == {"tokens": 5, "source": "max_tokens"} and given["max_tokens"] == 5
    r = httpx.post(pair.url + "/v1/completions", json={"prompt": [3, 4, 5], "temperature": 0, "max_tokens": None},
                   timeout=120)
    assert r.status_code == 200, r.text
    unknown = routed(pair.log)[-1]
    assert unknown["decode_estimate"]["source"] == "learned" and unknown["max_tokens"] > 400  # the context left
    assert 1 <= unknown["decode_estimate"]["tokens"] < unknown["max_tokens"]
    assert {c["decode_tokens"] for c in unknown["candidates"]} >= {unknown["decode_estimate"]["tokens"]}


def test_a_dead_worker_leaves_the_other_serving(pair):
    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 509, "ignore_eos": True, "worker": "cpu1"}
            task = asyncio.ensure_future(c.post(pair.url + "/v1/completions", json=body))
            await kill_when_running(c, pair, "cpu1")
            return await task

    r = asyncio.run(main())
    assert r.status_code == 503 and "cpu1 died" in r.json()["error"]["message"]
    assert httpx.get(pair.url + "/health").status_code == 200
    for i in range(3):
        assert complete(pair.url, [i + 5, 6], 3)["usage"]["completion_tokens"] == 3
    assert all([c["worker"] for c in line["candidates"]] == ["cpu0"] and line["choice"] == "cpu0"
               for line in routed(pair.log)[-3:])
    pinned = httpx.post(pair.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "worker": "cpu1"})
    assert pinned.status_code == 503


def test_llm_with_several_devices_routes_in_worker_processes(tiny_qwen2, tmp_path):
    prompts = [[(5 * i + 2 * k) % 390 + 1 for k in range(30 + 7 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = one_worker_outputs(tiny_qwen2, prompts, params)
    log = tmp_path / "route.jsonl"
    with LLM(model=tiny_qwen2, kv_cache_memory="16MiB", deterministic=True, route_log=str(log),
             devices=["cpu:threads=1", "cpu:threads=1"], route_policy="round-robin") as llm:
        assert llm.engine is None
        outs = llm.generate(prompts, params, use_tqdm=False)
        streamed = "".join(llm.stream(prompts[0], params))
        assert llm.last_output.token_ids == expected[0].token_ids
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert [o.text for o in outs] == [o.text for o in expected] and streamed == expected[0].text
    assert all(o.finish_reason == "length" for o in outs)
    assert [line["choice"] for line in routed(log)] == ["cpu0", "cpu1", "cpu0", "cpu1", "cpu0"]


def test_workers_without_a_profile_measure_one_at_start_up(tiny_qwen2):
    s = Server(tiny_qwen2, "--kv-cache-memory", "16MiB", "--inference-device", "cpu:threads=1",
               "--inference-device", "cpu:threads=1,max_num_seqs=4", "--route-policy", "round-robin")
    try:
        assert complete(s.url, [1, 2, 3], 2)["usage"]["completion_tokens"] == 2
    finally:
        assert s.stop() == 0
    out = s.proc.stdout.read()
    assert "worker cpu0 (cpu:threads=1): prefill tok/s {32: " in out and "(rounds agree within" in out
    assert "worker cpu1 (cpu:threads=1,max_num_seqs=4): prefill tok/s {32: " in out
