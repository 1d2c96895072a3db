"""Engine core on the tiny model: batching, chunking, preemption, aborts, stops, page accounting."""

from __future__ import annotations

import pytest

from hetserve import LLM, SamplingParams
from hetserve.core.engine import RequestRejected
from hetserve.core.request import Request
from hetserve.core.scheduler import PrefillPacer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [5, 17, 300, 42],
    [99, 7, 1, 2, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [60],
    list(range(30, 70)),
    [8, 8, 8, 8, 8, 8],
    list(range(100, 137)),
    [301, 302],
    list(range(200, 215)),
]


def make_llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "4MiB")
    kw.setdefault("page_size", 4)
    return LLM(model=path, **kw)


@pytest.fixture
def llm(tiny_qwen2):
    llm = make_llm(tiny_qwen2, deterministic=True)
    yield llm
    assert llm.engine.num_free_pages == llm.engine.pool.num_blocks, "pages leaked"


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_batched_equals_alone_deterministic(llm):
    together = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    assert together == alone
    assert all(len(t) == 24 for t in together)


def test_chunked_prefill_equals_whole_prefill(tiny_qwen2):
    whole = make_llm(tiny_qwen2, deterministic=True, max_num_batched_tokens=512)
    chunked = make_llm(tiny_qwen2, deterministic=True, max_num_batched_tokens=5)
    # The tiny budget forces 40-token prompts through 8 chunks mixed with other requests' decodes.
    assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
        tokens(whole.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_long_prompt_chunks_mix_with_decodes(tiny_qwen2):
    """The budget is of prompt tokens: decodes ride on top, and a prompt's chunk is never cut
    short by them (which left a prompt's last tokens, and its first token, to the next step)."""
    llm = make_llm(tiny_qwen2, max_num_batched_tokens=8)
    eng = llm.engine
    eng.add_request(Request("short", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0)))
    eng.step()  # short prefilled, now decoding
    eng.add_request(Request("long", list(range(40, 80)), SamplingParams(max_tokens=4, temperature=0)))
    eng.add_request(Request("next", list(range(90, 94)), SamplingParams(max_tokens=4, temperature=0)))
    sched = eng.scheduler.schedule()
    assert [(r.request_id, n) for r, n in sched.scheduled] == [("short", 1), ("long", 8)]  # next waits
    for r in list(eng.requests):
        eng.abort(r)
    assert eng.num_free_pages == eng.pool.num_blocks
    eng.add_request(Request("short2", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0)))
    eng.step()
    eng.add_request(Request("exact", list(range(100, 108)), SamplingParams(max_tokens=4, temperature=0)))
    sched = eng.scheduler.schedule()
    assert [(r.request_id, n) for r, n in sched.scheduled] == [("short2", 1), ("exact", 8)]  # whole, in one step
    for r in list(eng.requests):
        eng.abort(r)
    assert eng.num_free_pages == eng.pool.num_blocks


def test_prefill_pacer_sizes_chunks_from_timed_steps():
    p = PrefillPacer(target_s=1.0, cap=512, page_size=16)
    assert p.budget == 512  # nothing timed yet: the whole budget
    p.observe(32, 5.0)  # under 64 prompt tokens: the step's decodes, not its prefill, set its time
    assert p.budget == 512
    p.observe(512, 5.12)  # 10 ms a token: 100 tokens in a second, 96 in whole pages
    assert p.budget == 96
    for _ in range(30):
        p.observe(96, 4.0)  # the machine slows (or the decodes riding along cost more)
    assert p.budget == 64  # never under the floor: prompts still progress
    for _ in range(30):
        p.observe(512, 0.5)  # a CPU that prefills 1024 tokens a second
    assert p.budget == 512
    assert PrefillPacer(1.0, cap=8, page_size=4).floor == 8  # a budget under the floor is left alone


def test_prefill_pacer_sizes_chunks_by_their_depth_of_context():
    """A chunk deep in a context costs its attention too: the pacer gives it fewer tokens, the
    most that fit the target by its cost model, and learns the ratio of the two costs from steps
    whose depths differ (a machine whose attention costs twice the guess)."""
    from hetserve.core.scheduler import attention_pairs

    p = PrefillPacer(target_s=1.0, cap=512, page_size=16, floor=64, pair_ratio=5e-4)
    p.observe(512, 0.5, attention_pairs(512, 0))
    for depth in (0, 4096, 12288, 30000):
        n = p.tokens(depth, 1.0)
        assert p.seconds(n, depth) <= 1.0 and (n == 512 or p.seconds(n + 16, depth) > 1.0), depth
    assert p.tokens(12288, 1.0) < p.tokens(0, 1.0) / 3
    assert p.tokens(30000, 0.01, first=False) == 0 and p.tokens(30000, 0.01) == 64  # the floor, first chunks only
    a, r = 1e-3, 1e-3  # the machine's truth: a step's seconds = a (tokens + r pairs)
    for i in range(40):
        n, depth = (256, 512, 128)[i % 3], (0, 8000, 20000, 3000)[i % 4]
        p.observe(n, a * (n + r * attention_pairs(n, depth)), attention_pairs(n, depth))
    assert abs(p.pair_ratio - r) < 0.05 * r and abs(p.seconds_per_token - a) < 0.05 * a
    # steps all at the start of their contexts say nothing of r: it stays
    q = PrefillPacer(1.0, 512, 16, pair_ratio=5e-4)
    for _ in range(10):
        q.observe(512, 0.5, attention_pairs(512, 0))
    assert q.pair_ratio == 5e-4


def test_a_deep_chunk_beside_decodes_gets_the_tokens_its_depth_allows(tiny_qwen2):
    """An agent's next turn: its long prefix is in the prefix cache, so its first chunk starts
    deep. Beside a decoding stream it gets the tokens the pacer allows at that depth, fewer than
    the same prompt's first chunk from the start."""
    llm = make_llm(tiny_qwen2, max_num_batched_tokens=256, max_decode_stall=1.0, page_size=4)
    eng = llm.engine
    prefix = [(7 * i) % 390 + 1 for i in range(200)]
    llm.generate([prefix + [5]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # cached
    eng.add_request(Request("stream", [9, 8, 7], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)))
    eng.step()  # its prompt; it decodes from here on
    pacer = PrefillPacer(target_s=1.0, cap=256, page_size=4, floor=8, pair_ratio=3e-2)
    pacer.observe(100, 0.1, 0)  # 1 ms a token at the start of a context
    eng.scheduler.pacer = pacer
    eng.add_request(Request("turn2", prefix + list(range(20, 270)), SamplingParams(max_tokens=2, temperature=0)))
    sched = eng.scheduler.schedule()
    (stream, one), (turn, n) = sched.scheduled
    assert stream.request_id == "stream" and one == 1 and turn.request_id == "turn2"
    depth = turn.num_computed_tokens
    assert depth == 200  # the cached prefix's full pages
    assert n == pacer.tokens(depth, 1.0) < pacer.tokens(0, 1.0) / 1.5 and n < 250
    assert sched.num_prompt_pairs == n * depth + n * (n + 1) // 2
    for r in list(eng.requests):
        eng.abort(r)
    assert eng.num_free_pages == eng.pool.num_blocks


def test_decodes_cap_the_prompt_chunk_at_the_stall_budget(tiny_qwen2):
    """While a request decodes, a step's prompt chunk holds what the pacer says prefills in
    max_decode_stall seconds; with nothing decoding a prompt gets the whole budget."""
    llm = make_llm(tiny_qwen2, max_num_batched_tokens=64, max_decode_stall=10.0)
    eng = llm.engine
    eng.add_request(Request("first", list(range(1, 71)), SamplingParams(max_tokens=30, temperature=0)))
    eng.step()  # 64 prompt tokens, timed
    assert eng.scheduler.pacer.seconds_per_token is not None  # the step was timed (whatever it took)
    assert eng.scheduler.pacer.budget == 64  # the tiny model prefills far more than 64 tokens in 10 s
    eng.step()
    eng.step()  # first is decoding now
    eng.scheduler.pacer = PrefillPacer(target_s=1.0, cap=64, page_size=4, floor=8)
    eng.scheduler.pacer.observe(20, 1.0)  # as if a prompt token took 50 ms: 20 tokens a second
    eng.add_request(Request("long", list(range(100, 160)), SamplingParams(max_tokens=4, temperature=0)))
    sched = eng.scheduler.schedule()
    assert [(r.request_id, n) for r, n in sched.scheduled] == [("first", 1), ("long", 20)]
    assert sched.num_prompt_tokens == 20
    eng.abort("first")
    sched = eng.scheduler.schedule()  # nothing decodes (and no step ran): long's whole prompt at once
    assert [(r.request_id, n) for r, n in sched.scheduled] == [("long", 60)]
    for r in list(eng.requests):
        eng.abort(r)
    assert eng.num_free_pages == eng.pool.num_blocks


def test_kv_pressure_preempts_and_matches_unpressured(tiny_qwen2):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    relaxed = make_llm(tiny_qwen2, deterministic=True)
    expected = tokens(relaxed.generate(PROMPTS, params, use_tqdm=False))
    # Pages of 4 tokens; ~2 requests of (prompt + 40) fit in 50 pages.
    per_page = relaxed.model.kv_bytes_per_token() * 4
    tight = make_llm(tiny_qwen2, deterministic=True, kv_cache_memory=str(50 * per_page))
    assert tight.engine.pool.num_blocks == 50
    outs = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(outs) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) == tight.engine.scheduler.num_preemptions
    assert tight.engine.num_free_pages == 50


def test_contiguous_layout_matches_paged(tiny_qwen2):
    paged = make_llm(tiny_qwen2, deterministic=True)
    contiguous = make_llm(tiny_qwen2, deterministic=True, kv_cache="contiguous")
    assert tokens(contiguous.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
        tokens(paged.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert contiguous.engine.num_free_pages == contiguous.engine.pool.num_blocks


def test_request_that_can_never_fit_is_rejected_with_numbers(tiny_qwen2):
    per_page = make_llm(tiny_qwen2).model.kv_bytes_per_token() * 4
    llm = make_llm(tiny_qwen2, kv_cache_memory=str(10 * per_page))
    with pytest.raises(RequestRejected, match=r"prompt \(30 tokens\) \+ max_tokens \(20\) = 50 exceeds the KV "
                                              r"cache of 40 tokens \(10 pages of 4\)"):
        llm.generate([list(range(30))], SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(RequestRejected, match="exceeds the model's context of 512"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=600), use_tqdm=False)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        llm.generate([[1, 100000]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.num_free_pages == 10 and not llm.engine.has_unfinished_requests()


def test_abort_mid_prefill_and_mid_decode_frees_pages(tiny_qwen2):
    llm = make_llm(tiny_qwen2, max_num_batched_tokens=8)
    eng = llm.engine
    eng.add_request(Request("a", list(range(50, 90)), SamplingParams(max_tokens=30, ignore_eos=True)))
    eng.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
    eng.step()
    assert 0 < eng.requests["a"].num_computed_tokens < 40  # mid-prefill
    assert eng.abort("a")
    for _ in range(3):
        eng.step()
    assert eng.requests["b"].num_output_tokens > 0  # mid-decode
    assert eng.abort("b") and not eng.abort("b")
    assert eng.num_free_pages == eng.pool.num_blocks and not eng.has_unfinished_requests()


def test_max_tokens_and_eos_finish(llm):
    eos = llm.tokenizer.eos_token_id
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert len(out.token_ids) <= 5
    assert out.finish_reason == ("stop" if out.token_ids[-1] == eos else "length")


def test_stop_token_ids_end_output_exactly(llm):
    full = llm.generate([[5, 17, 300, 42]], GREEDY, use_tqdm=False)[0].token_ids
    stop_at = full[6]
    first = full.index(stop_at)
    out = llm.generate([[5, 17, 300, 42]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                          stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_strings_end_text_exactly(llm):
    full = llm.generate([[5, 17, 300, 42]], GREEDY, use_tqdm=False)[0]
    text = full.text
    assert len(text) > 12
    stop = text[5:9]
    out = llm.generate([[5, 17, 300, 42]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                          stop=[stop, "\x00never"]), use_tqdm=False)[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 24


def test_stop_string_is_held_back_while_streaming(llm):
    full = llm.generate([[5, 17, 300, 42]], GREEDY, use_tqdm=False)[0].text
    stop = full[8:12]
    deltas = list(llm.stream([5, 17, 300, 42], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                               stop=[stop])))
    assert "".join(deltas) == full[: full.index(stop)]
    assert all(stop not in d for d in deltas)


def test_min_tokens_blocks_eos(llm):
    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, stop_token_ids=[eos])
    out = llm.generate([[5, 17, 300, 42]], params, use_tqdm=False)[0]
    assert len(out.token_ids) == 12 and eos not in out.token_ids


def test_outputs_in_prompt_order_with_metrics(llm):
    outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.prompt_token_ids == p
        m = o.metrics
        assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"] <= m["finished_time"]
        assert m["num_prompt_tokens"] == len(p) and m["num_output_tokens"] == 24


def test_logprobs(llm):
    out = llm.generate([[5, 17, 300, 42]], SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3  # greedy token is the top-1
        assert lp[tok] == max(lp.values()) and all(v <= 0 for v in lp.values())


@pytest.mark.parametrize("policy,expected", [("fcfs", ["long", "mid", "short"]),
                                             ("shortest-prefill-first", ["short", "mid", "long"])])
def test_scheduling_policy_orders_admission(tiny_qwen2, policy, expected):
    llm = make_llm(tiny_qwen2, max_num_seqs=1, scheduling_policy=policy)
    eng = llm.engine
    for rid, n in (("long", 30), ("mid", 12), ("short", 3)):
        eng.add_request(Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=2, ignore_eos=True)))
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished == expected
    assert eng.num_free_pages == eng.pool.num_blocks
