"""Structured outputs in the engine, on the tiny model: every output matches its grammar, alone, in
batches, under preemption, after a KV move and with speculative decoding (greedy equal to the
target alone; lossless sampling exact for the masked distribution, chi-square bound)."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch
from test_disagg import engine, run_single, run_split
from test_spec_engine import assert_pages_back, make, tokens
from test_spec_sampler import P_VALUE_BOUND, _chi_square_p_value
from tiny_model import write_tiny_gguf

from hetserve import LLM, SamplingParams
from hetserve.core.request import Request
from hetserve.layers.attention import AttentionMetadata
from hetserve.structured import StructuredOutputError, StructuredOutputs
from hetserve.structured.params import NUMBER_FRACTION_DIGITS, bounded_numbers

PROMPTS = [[5, 17, 300, 42], [99, 7, 1, 2, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19], [60], list(range(30, 70))]
CONSTRAINTS = [
    (StructuredOutputs("regex", "[0-9]{3}-[a-z]{2,6}"), r"[0-9]{3}-[a-z]{2,6}"),
    (StructuredOutputs.choice(["red", "green", "blue"]), r"red|green|blue"),
    (StructuredOutputs("grammar", 'root ::= "(" digit ("," digit){0,3} ")"\ndigit ::= [0-9]'),
     r"\([0-9](,[0-9]){0,3}\)"),
    (StructuredOutputs.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"},
                                                                    "n": {"enum": [1, 2, 3]}},
                                    "required": ["ok", "n"], "additionalProperties": False}),
     r'\{"ok": (true|false), "n": [123]\}'),
]


def constrained(spec, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=kw.pop("max_tokens", 24), structured=spec, **kw)


@pytest.fixture(scope="module")
def llm(tiny_qwen2) -> LLM:
    return make(tiny_qwen2)


@pytest.mark.parametrize("spec,pattern", CONSTRAINTS, ids=["regex", "choice", "gbnf", "json"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_grammar(llm, spec, pattern, temperature):
    outs = llm.generate(PROMPTS, [constrained(spec, temperature=temperature, seed=i) for i in range(len(PROMPTS))],
                        use_tqdm=False)
    for o in outs:
        assert re.fullmatch(pattern, o.text), o.text
        assert o.finish_reason == "stop"
    assert_pages_back(llm)


@pytest.mark.parametrize("kind", ["integer", "number"])
def test_a_number_the_schema_leaves_unbounded_still_ends(llm, kind):
    """Biased toward digits, as a model stuck in one number is, every output still closes its
    object: an integer is held to what JSON parsers keep exactly (2**53 - 1), a number's fraction
    to NUMBER_FRACTION_DIGITS digits and no exponent."""
    spec = StructuredOutputs.json_schema({"type": "object", "properties": {"stars": {"type": kind, "minimum": 0}},
                                          "required": ["stars"], "additionalProperties": False})
    tok = llm.tokenizer
    digits = {i: 50.0 for i in range(tok.vocab_size) if tok.decode([i]).strip(".").isdigit()}
    outs = llm.generate(PROMPTS, [constrained(spec, temperature=1.0, seed=i, max_tokens=64, logit_bias=digits)
                                  for i in range(len(PROMPTS))], use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        stars = json.loads(o.text)["stars"]
        assert 0 <= stars <= 2**53 - 1, o.text
        written = re.search(r'"stars": ?([^}]*)}', o.text).group(1)
        whole, _, fraction = written.partition(".")
        assert whole.isdigit() and len(whole) <= 16, o.text
        assert fraction == "" if kind == "integer" else (fraction.isdigit() or fraction == ""), o.text
        assert len(fraction) <= NUMBER_FRACTION_DIGITS, o.text
    assert_pages_back(llm)


def test_number_bounds_apply_only_where_the_schema_sets_none():
    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer", "maximum": 10**20}, "c": {"type": ["integer", "null"]},
        "d": {"type": "integer", "exclusiveMinimum": 0}, "e": {"const": {"type": "integer"}}, "f": {"type": "number"},
        "g": {"type": "number", "multipleOf": 0.25, "minimum": 1}}}
    props = bounded_numbers(schema)["properties"]
    assert props["a"] == {"type": "integer", "minimum": -(2**53 - 1), "maximum": 2**53 - 1}
    assert props["b"] == {"type": "integer", "maximum": 10**20, "minimum": -(2**53 - 1)}
    assert props["c"]["maximum"] == 2**53 - 1 and "minimum" not in props["d"] and "multipleOf" not in props["c"]
    assert props["e"] == {"const": {"type": "integer"}}
    assert props["f"] == {"type": "number", "minimum": -(2**53 - 1), "maximum": 2**53 - 1,
                          "multipleOf": 10.0 ** -NUMBER_FRACTION_DIGITS}
    assert props["g"] == {"type": "number", "multipleOf": 0.25, "minimum": 1, "maximum": 2**53 - 1}
    assert schema["properties"]["a"] == {"type": "integer"}  # the caller's schema is not changed


def accepts(llm: LLM, spec: StructuredOutputs, text: str) -> bool:
    """Whether the request's grammar takes text, token by token, and may end there."""
    m = llm.engine.structured.compiler.compile(spec)
    return all(m.consume_token(t) for t in llm.tokenizer.encode(text, add_bos=False)) and m.is_accepting()


def test_a_bounded_number_keeps_its_fraction_digits_and_loses_its_exponent(llm):
    """What the grammar lets through, token by token: the cap, and no more than the cap."""
    spec = StructuredOutputs.json_schema({"type": "number"})
    for text, allowed in [("0.5", True), ("-3.25", True), ("0." + "1" * NUMBER_FRACTION_DIGITS, True),
                          ("0." + "1" * (NUMBER_FRACTION_DIGITS + 1), False), ("1e5", False), ("2.5E-3", False),
                          (str(2**53 - 1), True), (str(2**53), False)]:
        assert accepts(llm, spec, text) == allowed, text


def test_constrained_and_unconstrained_in_one_batch_do_not_disturb_each_other(llm):
    """Deterministic mode: a constrained greedy request gives the same tokens alone and among
    unconstrained ones, and the unconstrained ones the same tokens as without it."""
    spec, pattern = CONSTRAINTS[0]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], constrained(spec), use_tqdm=False)[0].token_ids
    others = tokens(llm.generate(PROMPTS[1:], plain, use_tqdm=False))
    mixed = llm.generate(PROMPTS, [constrained(spec)] + [plain] * 3, use_tqdm=False)
    assert mixed[0].token_ids == alone and re.fullmatch(pattern, mixed[0].text)
    assert tokens(mixed[1:]) == others


def test_mask_covers_the_padded_vocabulary(llm):
    """Ids past the tokenizer's (rows of a padded output layer) are never allowed under a grammar,
    and logits wider than the mask lose their extra ids too."""
    from hetserve.layers.sampler import SamplingRow, apply_penalties
    from hetserve.structured.compiler import GrammarCompiler
    from hetserve.structured.matcher import GrammarState
    tok = llm.tokenizer
    assert llm.engine.structured.compiler.vocab_size == llm.engine.model.lm_head.out_features
    assert llm.engine.structured.compiler._tokenizer.done()  # built while loading: no stall when requests run
    padded = tok.vocab_size + 64
    compiler = GrammarCompiler(tok.to_json(), padded, tok.stop_token_ids)
    allowed = GrammarState(compiler.compile(StructuredOutputs("regex", "[a-z]+")), padded).allowed()
    assert allowed.shape == (padded,) and not allowed[tok.vocab_size:].any() and allowed.any()
    logits = torch.zeros(padded + 8)
    apply_penalties(logits, SamplingRow(SamplingParams(), [1], 1, None, (), allowed))
    assert torch.isinf(logits[~torch.cat([allowed, torch.zeros(8, dtype=torch.bool)])]).all()
    assert torch.isfinite(logits[:padded][allowed]).all()


def test_preempted_constrained_requests_resume_their_grammar(tiny_qwen2):
    """A KV pool too small for all of them at once: requests are preempted and recomputed; their
    outputs still match and equal a run with room for all."""
    spec, pattern = CONSTRAINTS[3]
    ref = make(tiny_qwen2).generate(PROMPTS * 2, constrained(spec, max_tokens=40), use_tqdm=False)
    small = make(tiny_qwen2, kv_cache_memory="64KiB", max_num_seqs=8)
    outs = small.generate(PROMPTS * 2, constrained(spec, max_tokens=40), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == tokens(ref) and all(re.fullmatch(pattern, o.text) for o in outs)
    assert_pages_back(small)


def test_a_moved_request_rebuilds_its_grammar_state_from_its_tokens(tiny_qwen2):
    spec, pattern = CONSTRAINTS[0]
    params = lambda: constrained(spec)  # noqa: E731
    ref = run_single(engine(tiny_qwen2), PROMPTS, params)
    a, b = engine(tiny_qwen2), engine(tiny_qwen2)
    out, _ = run_split(a, b, PROMPTS, params)
    assert out == ref
    assert b.pool.num_free == b.pool.num_blocks


def test_grammar_failures_end_the_request_not_the_engine(llm):
    """A grammar that validates without a tokenizer may still fail to compile for this one; the
    request ends (abort) and the engine goes on."""
    bad = StructuredOutputs("lark", "start: <|no_such_token|>")
    good = constrained(CONSTRAINTS[1][0])
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4, structured=bad), good], use_tqdm=False)
    assert outs[0].finish_reason == "abort" and outs[0].token_ids == []
    assert re.fullmatch(CONSTRAINTS[1][1], outs[1].text)
    assert_pages_back(llm)


@pytest.mark.parametrize("make_spec", [
    lambda: StructuredOutputs("regex", "(a|aa)*(b|bb)*c" * 40),  # nested repetition, a classic blow-up
    lambda: StructuredOutputs("regex", "[a-z]{1000}{1000}"),
    lambda: StructuredOutputs.json_schema({"type": "object", "properties": {"a": _nest(40)}}),
    lambda: StructuredOutputs("regex", "x" * 300_000),
])
def test_pathological_constraints_are_refused_or_bounded(llm, make_spec):
    """Refused when made, or compiled within the parser's limits: never an unbounded compile."""
    import time
    t = time.perf_counter()
    try:
        spec = make_spec()
        spec.check()
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, structured=spec), use_tqdm=False)[0]
        assert out.finish_reason in ("length", "stop", "abort")
    except StructuredOutputError:
        pass
    assert time.perf_counter() - t < 120  # only an unbounded compile: a bounded one takes seconds at most
    assert_pages_back(llm)


def _nest(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# -- speculative decoding ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def near_draft(tiny_dir) -> str:
    return write_tiny_gguf(tiny_dir / "draft-near-structured.gguf", "qwen2", noise=0.05)


@pytest.mark.parametrize("spec,pattern", CONSTRAINTS, ids=["regex", "choice", "gbnf", "json"])
def test_greedy_speculation_with_a_grammar_equals_the_target_alone(tiny_qwen2, near_draft, spec, pattern):
    ref = make(tiny_qwen2).generate(PROMPTS, constrained(spec), use_tqdm=False)
    llm = make(tiny_qwen2, near_draft, num_speculative_tokens=3)
    outs = llm.generate(PROMPTS, constrained(spec), use_tqdm=False)
    assert tokens(outs) == tokens(ref) and all(re.fullmatch(pattern, o.text) for o in outs)
    assert llm.engine.spec_stats()["proposed"] > 0
    assert_pages_back(llm)


def _exact_joint(llm: LLM, prompt: list[int], first: int, letters: list[int], temperature: float) -> torch.Tensor:
    """The masked distribution of the three sampled tokens: the target's softmax over the allowed
    letters at each position, enumerated over every prefix."""
    eng = llm.engine
    ps = eng.pool.page_size
    pages = eng.pool.allocate(-(-(len(prompt) + 4) // ps))
    try:
        probs = {}
        for depth in range(3):
            for prefix in itertools.product(letters, repeat=depth):
                ids = prompt + [first, *prefix]
                meta = AttentionMetadata.build([len(ids)], [len(ids)], [pages], ps, eng.model.device, per_query=True)
                hidden = eng.model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, eng.runner.kv_caches)
                logits = eng.model.compute_logits(hidden[-1:])[0].float()
                probs[prefix] = (logits[letters] / temperature).softmax(-1).double()
    finally:
        eng.pool.free(pages)
    joint = torch.zeros([len(letters)] * 3, dtype=torch.float64)
    for idx in itertools.product(range(len(letters)), repeat=3):
        p = 1.0
        for d in range(3):
            p *= float(probs[tuple(letters[i] for i in idx[:d])][idx[d]])
        joint[idx] = p
    return joint.flatten()


def test_lossless_speculation_samples_the_masked_distribution(tiny_qwen2, near_draft):
    """Seeded draws of q[123]{3} with a draft (K = 3, every letter drafted and verified
    under the mask) follow the exact masked joint distribution (chi-square over 27 cells)."""
    llm = make(tiny_qwen2, near_draft, num_speculative_tokens=3, enable_prefix_caching=False)
    letters = ["1", "2", "3"]  # the qwen2 pre-tokenizer splits digits: q[123]{3} is always 4 tokens
    spec = StructuredOutputs("regex", "q[" + "".join(letters) + "]{3}")
    prompt = PROMPTS[0]
    n = 1500
    outs = llm.generate([prompt] * n, [constrained(spec, temperature=1.0, seed=s, max_tokens=5) for s in range(n)],
                        use_tqdm=False)
    ids = [llm.tokenizer.encode(c)[0] for c in letters]
    first = llm.tokenizer.encode("q")[0]
    counts = torch.zeros(27, dtype=torch.float64)
    for o in outs:
        assert o.token_ids[0] == first and len(o.token_ids) in (4, 5), o.text  # 5: the end token
        counts[sum(ids.index(t) * 3 ** (2 - d) for d, t in enumerate(o.token_ids[1:4]))] += 1
    expected = _exact_joint(llm, prompt, first, ids, 1.0)
    assert math.isclose(float(expected.sum()), 1.0, rel_tol=1e-6)
    assert llm.engine.spec_stats()["proposed"] > n  # the letters went through drafts
    assert _chi_square_p_value(counts, expected) > P_VALUE_BOUND
    assert_pages_back(llm)


def test_mentored_speculation_keeps_to_the_grammar(tiny_qwen2, near_draft):
    """The bounded-shift mode works on the masked p and q: outputs still always match."""
    llm = make(tiny_qwen2, near_draft, num_speculative_tokens=4, spec_tv_budget=0.5)
    for spec, pattern in CONSTRAINTS:
        outs = llm.generate(PROMPTS, [constrained(spec, temperature=1.0, seed=i) for i in range(4)], use_tqdm=False)
        assert all(re.fullmatch(pattern, o.text) for o in outs), [o.text for o in outs]
    assert_pages_back(llm)


def test_an_engine_without_a_tokenizer_refuses_constraints(tiny_qwen2):
    eng = engine(tiny_qwen2)
    eng.structured = None
    with pytest.raises(ValueError, match="structured outputs"):
        eng.add_request(Request("x", [1, 2], constrained(CONSTRAINTS[0][0])))


def test_a_slow_compile_never_stalls_other_requests(tiny_qwen2):
    """Grammars compile on their own thread: while one takes a second, an unconstrained request
    decodes to its end; the constrained one then runs."""
    import threading
    import time

    llm = make(tiny_qwen2)
    eng = llm.engine
    compiler = eng.structured.compiler
    release = threading.Event()
    real = compiler.compile
    compiler.compile = lambda spec: (release.wait(600), real(spec))[1]  # set below, or in the finally
    try:
        eng.add_request(Request("slow", PROMPTS[0], constrained(CONSTRAINTS[0][0])))
        eng.add_request(Request("plain", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
        done, t = {}, time.monotonic()
        while "plain" not in done:
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            assert time.monotonic() - t < 120  # only a hang: eight tokens while the compile waits
        assert "slow" in eng.structured.compiling and "slow" not in done
        eng.add_request(Request("gone", PROMPTS[2], constrained(CONSTRAINTS[1][0])))
        assert eng.abort("gone") and "gone" not in eng.structured.compiling  # aborted while compiling
        release.set()
        tokens_out = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.request_id == "slow":
                    tokens_out += o.new_token_ids
                    done[o.request_id] = o
        assert done["slow"].finish_reason == "stop"
        assert re.fullmatch(CONSTRAINTS[0][1], llm.tokenizer.decode(tokens_out))
    finally:
        release.set()
        compiler.compile = real
    assert_pages_back(llm)


def test_prefix_cache_hits_keep_constrained_outputs(tiny_qwen2):
    spec, pattern = CONSTRAINTS[3]
    llm = make(tiny_qwen2)
    first = llm.generate(PROMPTS[1:2], constrained(spec), use_tqdm=False)[0]
    again = llm.generate(PROMPTS[1:2], constrained(spec), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids and re.fullmatch(pattern, again.text)


def test_constraints_cross_the_wire_as_plain_values():
    import msgpack
    p = SamplingParams(max_tokens=4, structured=StructuredOutputs("regex", "a+", "guided_regex"))
    back = SamplingParams(**msgpack.unpackb(msgpack.packb(p.to_wire())))
    assert back.structured == p.structured
