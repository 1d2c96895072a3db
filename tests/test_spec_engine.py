"""Speculative decoding in the engine, on tiny models: greedy output equals the target alone,
page accounting after rejections, aborts and preemption, prefix-cache safety, stats."""

from __future__ import annotations

import pytest
import torch
from tiny_model import write_tiny_gguf

from hetserve import LLM, SamplingParams
from hetserve.core.request import Request
from hetserve.layers.sampler import argmax
from hetserve.speculative.policy import POLICIES, DraftPolicy, PolicyConfig
from hetserve.speculative.proposer import VocabularyMismatch

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [5, 17, 300, 42],
    [99, 7, 1, 2, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [60],
    list(range(30, 70)),
    [8, 8, 8, 8, 8, 8],
]


@pytest.fixture(scope="module")
def drafts(tiny_dir) -> dict[str, str]:
    """near: the target's weights plus noise (accepts about half of greedy drafts);
    small: an unrelated, smaller model with the same vocabulary (rejects almost everything)."""
    return {
        "near": write_tiny_gguf(tiny_dir / "draft-near.gguf", "qwen2", noise=0.05),
        "small": write_tiny_gguf(tiny_dir / "draft-small.gguf", "qwen2", seed=1, n_layers=1, hidden=32,
                                 n_heads=2, n_kv_heads=1, ffn=64),
    }


def make(path, draft=None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "4MiB")
    kw.setdefault("page_size", 4)
    kw.setdefault("deterministic", True)
    if draft:
        kw["speculative_model"] = draft
    return LLM(model=path, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def assert_pages_back(llm: LLM) -> None:
    eng = llm.engine
    assert eng.num_free_pages == eng.pool.num_blocks, "pages leaked"
    assert not eng.has_unfinished_requests()


@pytest.fixture(scope="module")
def target_only(tiny_qwen2) -> list[list[int]]:
    return tokens(make(tiny_qwen2).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_speculation_equals_target_alone_and_batched(tiny_qwen2, drafts, target_only, policy):
    llm = make(tiny_qwen2, drafts["near"], spec_policy=policy, num_speculative_tokens=3, spec_k_max=5)
    batched = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(batched) == target_only
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    assert alone == target_only
    stats = llm.engine.spec_stats()
    assert stats["rounds"] > 0 and 0 < stats["accepted"] < stats["proposed"], stats  # accepts and rejections
    if policy == "fixed":
        assert max(stats["k_histogram"]) == 3
    assert_pages_back(llm)


def test_greedy_speculation_equals_target_alone_outside_deterministic_mode(tiny_qwen2, drafts):
    """Without per-query mode too: verification rows and decode rows go through the same
    row-by-row attention and the batch-invariant int8 kernel, so a greedy round accepts exactly
    the target's tokens."""
    kw = {"deterministic": False, "weight_format": "int8"}
    target = make(tiny_qwen2, **kw)
    spec = make(tiny_qwen2, drafts["near"], num_speculative_tokens=4, **kw)
    for p in PROMPTS:
        assert (spec.generate([p], GREEDY, use_tqdm=False)[0].token_ids
                == target.generate([p], GREEDY, use_tqdm=False)[0].token_ids)
    assert spec.engine.spec_stats()["accepted"] > 0


def test_greedy_with_an_unrelated_smaller_draft_and_stop_token(tiny_qwen2, drafts, target_only):
    llm = make(tiny_qwen2, drafts["small"], num_speculative_tokens=4)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == target_only
    # A stop token: output ends at its first occurrence, even when it is an accepted draft.
    stop = target_only[3][7]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    same = make(tiny_qwen2, tiny_qwen2)  # accepts every draft, so the stop token is often an accepted one
    for engine in (llm, same):
        out = engine.generate([PROMPTS[3]], params, use_tqdm=False)[0]
        assert out.token_ids == target_only[3][:target_only[3].index(stop) + 1]
        assert out.finish_reason == "stop"
        assert_pages_back(engine)


def test_identical_draft_accepts_every_token_with_sampling_filters(tiny_qwen2):
    """Draft = target: p and q must come out of the same penalties, temperature and filters,
    position by position, or some drafts would be rejected. (Both with the same weights: the
    draft's default is int4.)"""
    llm = make(tiny_qwen2, tiny_qwen2, num_speculative_tokens=4, weight_format="fp32", speculative_weight_format="fp32")
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.3, min_tokens=6, seed=1, ignore_eos=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.engine.spec_stats()
    assert stats["proposed"] > 0 and stats["acceptance_rate"] == 1.0, stats
    for o in outs:
        s = o.metrics["spec_decode"]
        assert s["accepted"] == s["proposed"] and s["mean_accepted_length"] > 3.0
        assert len(o.token_ids) >= 6
    assert_pages_back(llm)


def test_draft_reads_prompt_chunks_in_the_targets_prefill_steps(tiny_qwen2):
    """The draft mirrors each prefill chunk, so the first round catches up over the first output
    token only; a prefix-cache hit restores the draft's KV of the pages it had computed. An
    identical draft must then still accept every token: its KV from both is the right one."""
    llm = make(tiny_qwen2, tiny_qwen2, num_speculative_tokens=3, max_num_batched_tokens=6,
               weight_format="fp32", speculative_weight_format="fp32")
    eng = llm.engine
    spans = []
    prefill = eng.speculation.proposer.prefill
    eng.speculation.proposer.prefill = lambda batch: (spans.extend((r.num_draft_computed, end) for r, end in batch),
                                          prefill(batch))
    prompt = list(range(200, 218))  # chunks of 6 (a last chunk of 1 token would verify drafts already)
    for rid in ("a", "b"):  # "b" hits the 4 full pages "a" published, with the draft's KV
        spans.clear()
        eng.add_request(Request(rid, prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
        req = eng.requests[rid]
        while eng.has_unfinished_requests():
            before = req.num_computed_tokens
            eng.step()
            if before < len(prompt):  # a prefill step: the draft is level with the target
                assert req.num_draft_computed == req.num_computed_tokens
        assert req.num_cached_tokens == (0 if rid == "a" else 16)
        assert spans == ([(0, 6), (6, 12), (12, 18)] if rid == "a" else [(16, 18)])
        assert req.spec.accepted == req.spec.proposed > 0
    # Pages that change hands lose the mark: a full pool evicts every cached page.
    assert eng.pool.draft_ready.any()
    eng.scheduler.pool.free(eng.scheduler.pool.allocate(eng.pool.num_blocks))
    assert not eng.pool.draft_ready.any()
    assert_pages_back(llm)


class DraftLater(DraftPolicy):
    """No drafts for the first `wait` decode steps (as a cost policy that stopped), then K."""

    def __init__(self, k: int, wait: int):
        super().__init__(PolicyConfig("fixed", k))
        self.wait = wait

    def draft_len(self, st):
        return 0 if st.k_histogram.get(0, 0) < self.wait else st.k


def test_a_long_draft_backlog_is_read_in_chunks_between_rounds(tiny_qwen2):
    """A draft that lags far behind (no drafts so far, or KV that came from a prefill worker)
    reads its backlog `draft_catch_up` tokens per decode step, not all in one round's first
    forward, which would stall every running request. An identical draft then still accepts
    every token, so the KV it read in chunks is the right one."""
    llm = make(tiny_qwen2, tiny_qwen2, num_speculative_tokens=3, weight_format="fp32",
               speculative_weight_format="fp32", enable_prefix_caching=False)
    eng = llm.engine
    eng.speculation.draft_catch_up = 6
    eng.set_speculation(DraftLater(3, wait=20), 0.0)
    reads = []
    prefill, propose = eng.speculation.proposer.prefill, eng.speculation.proposer.propose
    eng.speculation.proposer.prefill = lambda batch: (reads.extend(end - r.num_draft_computed for r, end in batch),
                                          prefill(batch))
    eng.speculation.proposer.propose = lambda batch, *args: (reads.extend(r.num_tokens - r.num_draft_computed for r, _ in batch),
                                                 propose(batch, *args))[1]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]  # 40 prompt tokens
    alone = make(tiny_qwen2, weight_format="fp32").generate([PROMPTS[3]], params, use_tqdm=False)[0]
    assert out.token_ids == alone.token_ids
    # K = 0 at prefill: no draft prefill; 20 decode steps later 60 tokens to read, 6 at a time.
    assert reads[:10] == [6] * 10 and max(reads) <= 6
    spec = out.metrics["spec_decode"]
    assert spec["accepted"] == spec["proposed"] > 0 and spec["k_histogram"][0] >= 20 + 9
    assert_pages_back(llm)


class Unsure(DraftPolicy):
    """Fixed K, but a round drafts no further after a token of draft probability below `least`;
    records every probability it is shown."""

    def __init__(self, k: int, least: float):
        super().__init__(PolicyConfig("fixed", k))
        self.least, self.seen = least, []

    def keep_drafting(self):
        return lambda p: self.seen.append(p) or p >= self.least


@pytest.mark.parametrize("least", [2.0, 0.07])
def test_a_round_stops_drafting_after_a_token_the_draft_was_unsure_of(tiny_qwen2, drafts, target_only, least):
    """Rounds that stop early verify fewer rows (K in the stats is what was drafted) and still
    give the target's tokens, alone and batched; their spare pages come back. least = 2: every
    round stops after its first draft; 0.07: about the median of the tiny near draft's
    probabilities (0.03-0.35)."""
    llm = make(tiny_qwen2, drafts["near"], num_speculative_tokens=4)
    policy = Unsure(4, least)
    llm.engine.set_speculation(policy, 0.0)
    rounds = []  # (rows run, drafts) of each speculating request in each step
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda scheduled: (
        rounds.extend((n, len(r.spec_token_ids)) for r, n in scheduled if r.spec_token_ids), execute(scheduled))[1]
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == target_only
    assert [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS] == target_only
    assert rounds and all(n == k + 1 for n, k in rounds)  # the target runs the drafts made, not the K scheduled
    hist = llm.engine.spec_stats()["k_histogram"]
    assert policy.seen and all(0.0 < p <= 1.0 for p in policy.seen)
    if least > 1:
        assert hist.get(1) and set(hist) <= {0, 1}  # K = 0: the last token of a request drafts nothing
    else:
        assert hist.get(4) and set(hist) - {4}, hist  # some rounds ran their K, some stopped
    assert_pages_back(llm)


def test_seeded_sampling_reproducible_and_batch_independent(tiny_qwen2, drafts):
    llm = make(tiny_qwen2, drafts["near"], num_speculative_tokens=3)
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True) for s in range(len(PROMPTS))]
    batched = tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    alone = [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(PROMPTS, params)]
    assert batched == alone
    assert len({tuple(t) for t in batched}) == len(PROMPTS)
    assert_pages_back(llm)


def test_tv_budget_one_accepts_every_sampled_draft_and_leaves_greedy_exact(tiny_qwen2, drafts, target_only):
    llm = make(tiny_qwen2, drafts["small"], spec_tv_budget=1.0, num_speculative_tokens=3)
    sampled = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0.8, seed=0, ignore_eos=True),
                           use_tqdm=False)
    assert all(o.metrics["spec_decode"]["acceptance_rate"] == 1.0 for o in sampled)
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(greedy) == target_only  # temperature 0 always uses the greedy rule
    assert_pages_back(llm)


def test_logprobs_match_target_alone(tiny_qwen2, drafts):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    ref = make(tiny_qwen2).generate(PROMPTS[:3], params, use_tqdm=False)
    got = make(tiny_qwen2, drafts["near"], num_speculative_tokens=3).generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == 12
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-5 for t in x)


def test_preemption_of_speculating_requests(tiny_qwen2, drafts):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = tokens(make(tiny_qwen2).generate(PROMPTS, params, use_tqdm=False))
    probe = make(tiny_qwen2, drafts["near"])
    per_page = (probe.model.kv_bytes_per_token() + probe.engine.speculation.proposer.model.kv_bytes_per_token()) * 4
    tight = make(tiny_qwen2, drafts["near"], kv_cache_memory=str(40 * per_page), num_speculative_tokens=4)
    assert tight.engine.pool.num_blocks == 40
    outs = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(outs) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.spec_stats()["rounds"] > 0
    assert_pages_back(tight)


def test_abort_while_speculating_and_rejected_pages_trimmed(tiny_qwen2, drafts):
    llm = make(tiny_qwen2, drafts["small"], num_speculative_tokens=6)
    eng = llm.engine
    eng.add_request(Request("a", [5, 17, 300, 42], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
    eng.add_request(Request("b", list(range(30, 45)), SamplingParams(max_tokens=30, temperature=0.7, seed=2,
                                                                       ignore_eos=True)))
    eng.step()  # prefill both
    for _ in range(3):
        eng.step()
        for r in eng.scheduler.running:
            # After verification only the pages of committed tokens are kept.
            assert len(r.block_ids) == eng.pool.pages_for(r.num_tokens)
            assert r.num_computed_tokens == r.num_tokens - 1
            assert r.num_draft_computed <= r.num_computed_tokens
            assert not r.spec_token_ids
    assert eng.requests["a"].spec.rounds == 3
    assert eng.abort("a")
    eng.step()
    assert eng.abort("b")
    assert_pages_back(llm)


def test_unverified_drafts_never_reach_the_prefix_cache(tiny_qwen2, drafts):
    llm = make(tiny_qwen2, drafts["small"], num_speculative_tokens=5)
    prompt = list(range(100, 123))
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    full = prompt + first.token_ids
    cache = llm.engine.prefix_cache
    assert cache.num_cached_pages > 0
    for entry in cache._by_hash.values():  # every cached page holds a slice of the real tokens
        page_tokens = list(entry.token_ids)
        assert any(full[i:i + 4] == page_tokens for i in range(0, len(full), 4)), page_tokens
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]  # restores the target's pages, draft recomputes
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    assert_pages_back(llm)


def test_vocabulary_mismatch_is_a_clear_error(tiny_qwen2, tiny_llama):
    with pytest.raises(VocabularyMismatch, match="share a tokenizer|vocabulary"):
        make(tiny_qwen2, tiny_llama)


def test_stats_add_up(tiny_qwen2, drafts):
    llm = make(tiny_qwen2, drafts["near"], spec_policy="acceptance-rate", num_speculative_tokens=2, spec_k_max=4)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    total = {"proposed": 0, "accepted": 0, "rounds": 0}
    for o in outs:
        s = o.metrics["spec_decode"]
        hist = s["k_histogram"]
        assert s["proposed"] == sum(k * n for k, n in hist.items())
        assert s["rounds"] == sum(n for k, n in hist.items() if k)
        assert sum(hist.values()) + s["accepted"] == 19  # each decode step commits its accepted drafts + 1
        assert s["acceptance_rate"] == round(s["accepted"] / s["proposed"], 4)
        assert s["mean_accepted_length"] == round(s["accepted"] / s["rounds"], 4)
        for key in total:
            total[key] += s[key]
    stats = llm.engine.spec_stats()
    assert {k: stats[k] for k in total} == total
    assert max(stats["k_histogram"]) > 2 or min(stats["k_histogram"]) < 2  # the policy moved K


@pytest.mark.parametrize("kw", [dict(kv_cache="contiguous"), dict(max_num_batched_tokens=6)])
def test_contiguous_layout_and_a_tiny_token_budget(tiny_qwen2, drafts, target_only, kw):
    """Drafts ride along other requests' decodes and prefill chunks cut to a tiny prompt-token budget."""
    llm = make(tiny_qwen2, drafts["near"], num_speculative_tokens=4, **kw)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == target_only
    assert llm.engine.spec_stats()["rounds"] > 0
    assert_pages_back(llm)


def test_engine_stats_reach_worker_state_and_prometheus(tiny_qwen2, drafts):
    from hetserve.serving import ipc
    from hetserve.serving.metrics import Metrics
    from hetserve.serving.worker import _state

    llm = make(tiny_qwen2, drafts["near"], num_speculative_tokens=3)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    stats = llm.engine.spec_stats()
    msg = ipc.decode(ipc.encode(ipc.Outputs("cpu", [], _state(llm.engine))))  # string keys on the wire
    spec = msg.state.spec_decode
    assert spec["proposed"] == stats["proposed"] and spec["k_3"] == stats["k_histogram"][3]
    m = Metrics()
    m.worker_state("cpu", msg.state)
    text = m.render().decode()
    assert f'hetserve:spec_decode{{counter="accepted",worker="cpu"}} {float(stats["accepted"])}' in text


def test_draft_vocab_ids_keep_the_first_normal_tokens_and_every_control_token():
    from hetserve.speculative.proposer import draft_vocab_ids

    # types: 1 normal, 3 control, 4 user-defined, 5 unused, 6 byte
    types = [1, 1, 3, 1, 5, 1, 4, 6]
    assert draft_vocab_ids(types, 2).tolist() == [0, 1, 2, 6, 7]
    assert draft_vocab_ids(types, 100).tolist() == [0, 1, 2, 3, 5, 6, 7]


def test_reduced_draft_vocabulary_scores_only_its_ids_and_keeps_output_exact(tiny_qwen2, drafts, target_only):
    """The draft's restricted output layer gives the same logits on its ids and -inf elsewhere;
    greedy output still equals the target's, and seeded sampling stays reproducible."""
    full = make(tiny_qwen2, drafts["near"], num_speculative_tokens=3, speculative_draft_vocab=0)
    llm = make(tiny_qwen2, drafts["near"], num_speculative_tokens=3, speculative_draft_vocab=100)
    draft, ref = llm.engine.speculation.proposer.model, full.engine.speculation.proposer.model
    ids = draft.logit_ids
    specials = [i for i in llm.tokenizer.special_token_ids if i < draft.num_logits]
    assert len(ids) == 100 + len(specials) and set(specials) <= set(ids.tolist())
    hidden = torch.randn(3, draft.config.hidden_size)
    got, want = draft.compute_logits(hidden), ref.compute_logits(hidden)
    outside = torch.ones(draft.num_logits, dtype=torch.bool)
    outside[ids] = False
    assert got.shape == want.shape and torch.equal(got[:, ids], want[:, ids])
    assert torch.all(got[:, outside] == float("-inf"))
    # Greedy drafts are picked on the scored columns alone: the same tokens as over the full rows.
    scored = draft.compute_logits(hidden, scored_only=True)
    assert scored.shape == (3, len(ids)) and torch.equal(draft.full_logits(scored), got)
    assert ids[argmax(scored)].tolist() == argmax(got).tolist()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == target_only
    # A penalty makes the draft score the whole vocabulary again; the output stays the target's.
    penalized = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    assert (tokens(llm.generate(PROMPTS, penalized, use_tqdm=False))
            == tokens(make(tiny_qwen2).generate(PROMPTS, penalized, use_tqdm=False)))
    stats = llm.engine.spec_stats()
    assert stats["rounds"] > 0 and stats["accepted"] > 0, stats
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert tokens(first) == tokens(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    assert_pages_back(llm)


def test_cost_policy_measures_step_costs_at_start(tiny_qwen2, drafts, target_only):
    llm = make(tiny_qwen2, drafts["near"], spec_policy="cost", spec_k_max=5)
    pol = llm.engine.speculation.policy
    assert sorted(pol.target.points) == list(range(1, 7)) and pol.target.known
    assert list(pol.draft.points) == [1] and pol.draft.known
    assert list(pol.draft_first.points) == [1] and pol.draft_first.known  # a 2-token forward
    assert list(pol.catch_up.points) == [llm.engine.speculation.draft_catch_up] and pol.skip_cost() > 0
    assert all(v > 0 for v in pol.target.points.values())
    assert_pages_back(llm)  # the scratch forwards hold no page
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == target_only


def test_set_speculation_swaps_policy_and_tv_budget_between_requests(tiny_qwen2, drafts, target_only):
    """`bench speculative` runs every setting on one engine: a fixed K = 0 policy is the target
    alone (no draft forward at all), and a swap mid-request is refused."""
    llm = make(tiny_qwen2, drafts["near"], num_speculative_tokens=3, enable_prefix_caching=False)
    eng = llm.engine
    off, fixed = eng.make_spec_policy("fixed", 0), eng.speculation.policy
    calls = []
    draft_forward = eng.speculation.proposer.model.forward
    eng.speculation.proposer.model.forward = lambda *a, **kw: calls.append(1) or draft_forward(*a, **kw)
    eng.set_speculation(off, 0.0)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outs) == target_only and not calls
    assert all(set(o.metrics["spec_decode"]["k_histogram"]) == {0} for o in outs)
    eng.set_speculation(fixed, 1.0)
    assert eng.runner.tv_budget == 1.0
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == target_only and calls
    eng.add_request(Request("busy", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0)))
    with pytest.raises(RuntimeError, match="between requests"):
        eng.set_speculation(off, 0.0)
    eng.abort("busy")
    assert_pages_back(llm)


def test_cost_policy_measured_later_never_overwrites_cached_pages(tiny_qwen2, drafts, target_only):
    """A cost policy made after requests ran times its scratch forwards on pages taken from the
    pool (evicting a cached page if it must), never on a page the prefix cache still indexes."""
    llm = make(tiny_qwen2, drafts["near"])
    eng = llm.engine
    assert llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0].token_ids == target_only[3]
    assert eng.pool._cached[0]  # its first page: where the start-up measurement ran
    eng.set_speculation(eng.make_spec_policy("cost", 2), 0.0)
    assert_pages_back(llm)
    again = llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 36 and again.token_ids == target_only[3]
