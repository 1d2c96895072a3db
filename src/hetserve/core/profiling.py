"""Measure an engine's speed in isolation: prefill tok/s by prompt length, decode tok/s by batch size.

The router's cost model divides pending work by these rates. Prompts are random token ids
with a distinct head per request, so no measurement hits the prefix cache. Decode rates
count every row of a step (a batch of 4 producing 4 tokens per step counts 4).
"""

from __future__ import annotations

import random
import time

import torch

from ..sampling_params import SamplingParams
from .engine import EngineCore
from .request import Request

FULL = {"prompt_lens": (64, 128, 256, 512), "batch_sizes": (1, 2, 4, 8), "decode_steps": 16}
SHORT = {"prompt_lens": (32, 128), "batch_sizes": (1, 4), "decode_steps": 6}  # a few seconds at start-up


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
