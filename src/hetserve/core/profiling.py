"""Measure an engine's speed in isolation: prefill tok/s by prompt length, decode tok/s by batch size.

The router's cost model divides pending work by these rates. Prompts are random token ids
with a distinct head per request, so no measurement hits the prefix cache. Decode rates
count every row of a step (a batch of 4 producing 4 tokens per step counts 4).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import statistics
import tempfile
import time

import torch

from ..sampling_params import SamplingParams
from .engine import EngineCore
from .request import Request

FULL = {"prompt_lens": (64, 128, 256, 512), "batch_sizes": (1, 2, 4, 8), "decode_steps": 16}
SHORT = {"prompt_lens": (32, 128), "batch_sizes": (1, 4), "decode_steps": 6}  # a few seconds at start-up
STABLE_SPREAD = 0.10  # rounds agree when every point's (max - min) / median is at most this
MIN_ROUNDS, MAX_ROUNDS = 3, 6
LOCK_PATH = os.path.join(tempfile.gettempdir(), "hetserve-profile.lock")


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@torch.inference_mode()
def measure(engine: EngineCore, prompt_lens=FULL["prompt_lens"], batch_sizes=FULL["batch_sizes"],
            decode_steps: int = FULL["decode_steps"], seed: int = 0) -> dict:
    """{"prefill": [[tokens, tok/s], ...], "decode": [[batch, tok/s], ...]} on this engine."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    limit = min(engine.max_model_len, engine.pool.num_blocks * engine.pool.page_size)
    ids = iter(range(1 << 30))

    def run(prompts: list[list[int]], max_tokens: int) -> list[Request]:
        reqs = [Request(f"profile-{next(ids)}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True)) for p in prompts]
        for r in reqs:
            engine.add_request(r)
        return reqs

    run([_prompt(rng, vocab, 16)], 2)  # warm-up: first calls pay for allocation and kernel selection
    engine.run_until_done()
    prefill = []
    for n in prompt_lens:
        if n + 1 > limit:
            continue
        t0 = time.perf_counter()
        run([_prompt(rng, vocab, n)], 1)
        engine.run_until_done()
        prefill.append([n, round(n / (time.perf_counter() - t0), 2)])
    decode = []
    for b in batch_sizes:
        if b > engine.config.max_num_seqs or b * (16 + decode_steps + 2) > limit:
            continue
        reqs = run([_prompt(rng, vocab, 16) for _ in range(b)], decode_steps + 2)
        while any(r.num_output_tokens == 0 for r in reqs):  # prefill (and the first token) untimed
            engine.step()
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            engine.step()
        decode.append([b, round(b * decode_steps / (time.perf_counter() - t0), 2)])
        engine.run_until_done()
    if not prefill or not decode:
        raise ValueError("the KV cache or max_num_seqs is too small to measure a profile")
    return {"prefill": prefill, "decode": decode}


@contextlib.contextmanager
def machine_lock(path: str = LOCK_PATH):
    """Held while a worker loads and measures itself: workers that share a machine (of one server
    or several) then load and measure one at a time, so that none measures beside another's
    loading or measurement."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure_stable(engine: EngineCore, prompt_lens=SHORT["prompt_lens"], batch_sizes=SHORT["batch_sizes"],
                   decode_steps: int = SHORT["decode_steps"], spread: float = STABLE_SPREAD) -> dict:
    """`measure` in rounds until they agree: at least MIN_ROUNDS, then more (up to MAX_ROUNDS)
    while a point's spread ((max - min) / median of its rates) is above `spread`. The profile is
    each point's median, with its spread and the rounds run, so a reader sees how sure it is.
    `hetserve profile` and a worker's start-up measurement are this same function."""
    rounds = []
    while len(rounds) < MAX_ROUNDS:
        rounds.append(measure(engine, prompt_lens, batch_sizes, decode_steps, seed=len(rounds)))
        if len(rounds) >= MIN_ROUNDS and _spread(rounds)[0] <= spread:
            break
    worst, by_point = _spread(rounds)
    out = {}
    for kind in ("prefill", "decode"):
        out[kind] = [[x, round(statistics.median(r[kind][i][1] for r in rounds), 2)]
                     for i, (x, _) in enumerate(rounds[0][kind])]
    out["spread"] = {**by_point, "worst": round(worst, 4)}
    out["rounds"] = len(rounds)
    return out


def _spread(rounds: list[dict]) -> tuple[float, dict]:
    by_point = {}
    for kind in ("prefill", "decode"):
        rows = []
        for i, (x, _) in enumerate(rounds[0][kind]):
            rates = [r[kind][i][1] for r in rounds]
            rows.append([x, round((max(rates) - min(rates)) / statistics.median(rates), 4)])
        by_point[kind] = rows
    worst = max(v for kind in by_point.values() for _, v in kind)
    return worst, by_point


PROBES = [("prefill", n) for n in SHORT["prompt_lens"]] + [("decode", b) for b in SHORT["batch_sizes"]]


@torch.inference_mode()
def probe(engine: EngineCore, kind: str, size: int, seed: int | None = None) -> list:
    """A short timed run on an idle engine at one of the profile's sizes (PROBES): a prompt of
    `size` random ids, or `size` short prompts and two decode steps of that batch;
    [prompt tokens, decode rows, seconds] per step, as a worker reports its steps. Its pages are
    freed when it ends; being random, they match no real prompt."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    limit = min(engine.max_model_len, engine.pool.num_blocks * engine.pool.page_size)
    if kind == "prefill":
        prompts, max_tokens = [_prompt(rng, vocab, min(size, limit - 2))], 1
    else:
        prompts, max_tokens = [_prompt(rng, vocab, 8) for _ in range(min(size, engine.config.max_num_seqs))], 3
    for p in prompts:
        engine.add_request(Request(f"probe-{rng.getrandbits(48):x}", p, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    steps, starts = [], []
    while engine.has_unfinished_requests():  # each step timed start to start, as the worker times them
        starts.append(time.perf_counter())
        engine.step()
        steps.append(engine.last_step)
    starts.append(time.perf_counter())
    return [[*step, end - start] for step, start, end in zip(steps, starts, starts[1:]) if step is not None]
