"""Prefill/decode disaggregation in-process: two EngineCores on the tiny model, KV export/import."""

from __future__ import annotations

import pytest
import torch
from test_routing_server import one_thread

from hetserve.core.loading import load_engine
from hetserve.core.request import Request, RequestStatus
from hetserve.layers import kv_quant
from hetserve.disagg import KVExport, NoRoomYet, TransferError, export_request, import_request
from hetserve.sampling_params import SamplingParams

PROMPTS = [[(5 * i + 3 * j) % 390 + 1 for i in range(n)] for j, n in enumerate((40, 7, 33, 16))]


def engine(model, **kw):
    return load_engine(model, deterministic=True, kv_cache_memory=kw.pop("kv_cache_memory", "4MiB"), **kw).engine


def params(n=12, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def run_single(eng, prompts, p) -> list[list[int]]:
    reqs = [Request(f"r{i}", ids, p()) for i, ids in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    return [r.output_token_ids for r in reqs]


def run_split(a, b, prompts, p) -> tuple[list[list[int]], list[KVExport]]:
    """Prefill on a, export, import into b, release on a, decode on b."""
    reqs = [Request(f"r{i}", ids, p()) for i, ids in enumerate(prompts)]
    for r in reqs:
        a.add_request(r, prefill_only=True)
    a.run_until_done()
    assert set(a.parked) == {r.request_id for r in reqs}
    exports, moved = [], []
    for r in reqs:
        x = export_request(a, r.request_id)
        dtype = getattr(torch, x.dtype)  # the sender's cache (fp16 by default; int8: q8_0 rows)
        row = kv_quant.row_elems(dtype, x.head_dim) * dtype.itemsize
        assert x.nbytes == 2 * len(x.k) * x.num_computed_tokens * x.num_kv_heads * row
        moved.append(import_request(b, KVExport(**x.to_dict())))
        assert a.abort(r.request_id, RequestStatus.FINISHED_STOPPED)
        exports.append(x)
    b.run_until_done()
    return [m.output_token_ids for m in moved], exports


@pytest.mark.parametrize("b_kw", [{}, {"page_size": 8}, {"weight_format": "fp32", "dtype": "bfloat16"}],
                         ids=["same", "page-size", "dtype"])
def test_split_equals_single_engine_and_pages_back(tiny_qwen2, b_kw):
    with one_thread():
        ref = run_single(engine(tiny_qwen2), PROMPTS, params)
        a, b = engine(tiny_qwen2), engine(tiny_qwen2, **b_kw)
        base_a, base_b = a.pool.num_free, b.pool.num_free
        out, exports = run_split(a, b, PROMPTS, params)
    if "dtype" not in b_kw:  # bf16 KV on the decoder: converted, not bit-equal
        assert out == ref
    else:
        assert all(len(o) == 12 and o[0] == r[0] for o, r in zip(out, ref))
    assert exports[0].num_computed_tokens == len(PROMPTS[0])
    assert a.pool.num_free == base_a and b.pool.num_free == base_b
    assert not a.requests and not b.requests and not a.parked
    # the prompts' full pages are in both prefix caches
    assert a.prefix_cache.num_cached_pages > 0 and b.prefix_cache.num_cached_pages > 0


def test_seeded_sampling_continues_the_stream(tiny_qwen2):
    p = lambda: SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)  # noqa: E731
    with one_thread():
        ref = run_single(engine(tiny_qwen2), PROMPTS[:2], p)
        out, _ = run_split(engine(tiny_qwen2), engine(tiny_qwen2), PROMPTS[:2], p)
    assert out == ref


def test_speculating_decode_worker_reads_the_drafts_backlog_in_chunks(tiny_qwen2):
    """The KV that arrives holds no draft KV: the decode worker's draft reads the prompt
    `draft_catch_up` tokens per step before its first round, instead of stalling one step for
    all of it. An identical draft then accepts every token, and the output is the single engine's."""
    fp32 = dict(weight_format="fp32")
    with one_thread():
        ref = run_single(engine(tiny_qwen2, **fp32), PROMPTS, params)
        a = engine(tiny_qwen2, **fp32)
        b = engine(tiny_qwen2, speculative_model=tiny_qwen2, speculative_weight_format="fp32",
                   num_speculative_tokens=3, **fp32)
        b.speculation.draft_catch_up = 8
        reads = []
        prefill, propose = b.speculation.proposer.prefill, b.speculation.proposer.propose
        b.speculation.proposer.prefill = lambda batch: (reads.extend(end - r.num_draft_computed for r, end in batch),
                                            prefill(batch))
        b.speculation.proposer.propose = lambda batch, *args: (
            reads.extend(r.num_tokens - r.num_draft_computed for r, _ in batch), propose(batch, *args))[1]
        out, _ = run_split(a, b, PROMPTS, params)
    assert out == ref
    assert max(reads) <= 8 and reads.count(8) >= len(PROMPTS[0]) // 8
    stats = b.spec_stats()
    assert stats["accepted"] == stats["proposed"] > 0
    assert b.pool.num_free == b.pool.num_blocks and not b.requests


def test_receiver_without_room_refuses_untouched_then_takes_the_transfer_once_pages_free(tiny_qwen2):
    with one_thread():
        ref = run_single(engine(tiny_qwen2), PROMPTS[:1], lambda: params(4))[0]
        a = engine(tiny_qwen2)
        small = engine(tiny_qwen2, kv_cache_memory="64KiB")
        ps = small.pool.page_size
        r = Request("big", PROMPTS[0], params(4))
        a.add_request(r, prefill_only=True)
        a.run_until_done()
        x = export_request(a, "big")
        # fill the receiver so the transfer cannot fit now
        hog = Request("hog", [1] * (small.pool.num_blocks * ps - 8), params(4))
        small.add_request(hog)
        while hog.num_computed_tokens < hog.num_prompt_tokens:
            small.step()
        free = small.pool.num_free
        with pytest.raises(NoRoomYet, match="needs .* pages"):  # retryable: a worker waits, then retries
            import_request(small, x)
        assert small.pool.num_free == free and "big" not in small.requests
        small.run_until_done()  # the hog finishes and frees its pages
        moved = import_request(small, x)
        a.abort("big", RequestStatus.FINISHED_STOPPED)
        small.run_until_done()
    assert moved.output_token_ids == ref
    assert a.pool.num_free == a.pool.num_blocks and small.pool.num_free == small.pool.num_blocks


def test_receiver_keeps_its_max_num_seqs(tiny_qwen2):
    with one_thread():
        a, b = engine(tiny_qwen2), engine(tiny_qwen2, max_num_seqs=1)
        for rid, ids in (("x", PROMPTS[0]), ("y", PROMPTS[1])):
            a.add_request(Request(rid, ids, params(4)), prefill_only=True)
        a.run_until_done()
        import_request(b, export_request(a, "x"))
        with pytest.raises(NoRoomYet, match="max_num_seqs=1"):
            import_request(b, export_request(a, "y"))
        b.run_until_done()
        assert import_request(b, export_request(a, "y")).request_id == "y"
        b.run_until_done()
        for rid in ("x", "y"):
            a.abort(rid, RequestStatus.FINISHED_STOPPED)
    assert b.pool.num_free == b.pool.num_blocks and a.pool.num_free == a.pool.num_blocks


def test_bad_payloads_are_refused(tiny_qwen2):
    with one_thread():
        a, b = engine(tiny_qwen2), engine(tiny_qwen2)
        a.add_request(Request("x", PROMPTS[0], params(4)), prefill_only=True)
        a.run_until_done()
        x = export_request(a, "x")
    base = b.pool.num_free
    bad = [dict(k=x.k[:-1]), dict(v=[x.v[0][:-4]] + x.v[1:]), dict(dtype="int64"),
           dict(num_kv_heads=x.num_kv_heads + 1), dict(page_hashes=[bytes(32)] * len(x.page_hashes))]
    for change in bad:
        with pytest.raises(TransferError):
            import_request(b, KVExport(**{**x.to_dict(), **change}))
        assert b.pool.num_free == base and not b.requests
    with pytest.raises(TransferError, match="not parked"):
        export_request(b, "x")


def test_router_splits_only_when_the_transfer_is_repaid():
    from hetserve.serving.router import Candidate, choose_split

    def cand(name, prefill_s, decode_s):
        return Candidate(name, 0, 0, 0, 100, 100, prefill_s, decode_s)

    # A prefills fast, B decodes fast: splitting saves 4 s, the transfer costs 0.001 s
    s = choose_split([cand("a", 1.0, 5.0), cand("b", 4.0, 1.0)], 1000, 1000, 1e9)
    assert (s.prefill, s.decode) == ("a", "b") and s.score == pytest.approx(2.001) and s.best_whole == 5.0
    # a slow link: 1000 tokens x 1000 bytes at 1e5 B/s = 10 s, more than the split saves
    assert choose_split([cand("a", 1.0, 5.0), cand("b", 4.0, 1.0)], 1000, 1000, 1e5) is None
    # one worker best at both: no split
    assert choose_split([cand("a", 1.0, 1.0), cand("b", 4.0, 5.0)], 1000, 1000, 1e9) is None
    assert choose_split([cand("a", 1.0, 1.0)], 10, 10, 1e9) is None
