"""Prefix caching, publication policies and single-flight coordination (tiny model, page size 16)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetserve import LLM, SamplingParams
from hetserve.core.flight import FlightCoordinator, Role
from hetserve.core.request import Request
from hetserve.kv.block_pool import BlockPool
from hetserve.kv.prefix_cache import PrefixCache, chain_hashes, root_hash
from tiny_model import write_tiny_gguf

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_ctx_model(tmp_path_factory) -> str:
    return write_tiny_gguf(tmp_path_factory.mktemp("ctx") / "tiny-2k.gguf", context=2048)


def make(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    kw.setdefault("deterministic", True)
    return LLM(model=path, **kw)


def toks(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 390 + 1 for i in range(n)]


def baseline(llm: LLM) -> None:
    eng = llm.engine
    assert eng.num_free_pages == eng.pool.num_blocks, "a page is still referenced"
    assert not eng.held and eng.flights.num_tracked == 0


def cached_tokens(llm, prompt, params=GREEDY) -> int:
    return llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens


def test_restored_token_counts(long_ctx_model):
    llm = make(long_ctx_model)
    p532 = toks(532)
    assert cached_tokens(llm, p532) == 0
    assert cached_tokens(llm, p532) == 528  # 33 full pages; the last prompt token is always computed
    doc = toks(880, offset=3)
    cached_tokens(llm, doc)
    assert cached_tokens(llm, doc + toks(24, offset=5)) == 880
    p15 = toks(15, offset=9)
    cached_tokens(llm, p15)
    assert cached_tokens(llm, p15) == 0  # no full page
    stats = llm.engine.prefix_cache_stats()
    assert stats["restored_tokens"] == 528 + 880 and stats["hits"] == 2 and stats["lookups"] == 6
    assert stats["cached_pages"] > 0 and stats["published_tokens"] >= (528 + 880)
    baseline(llm)


def test_greedy_identical_with_and_without_caching(long_ctx_model):
    doc = toks(200, offset=11)
    prompts = [doc + toks(10), doc + toks(10), doc[:100] + toks(37, offset=2), toks(50), doc + toks(10)]
    on, off = make(long_ctx_model), make(long_ctx_model, enable_prefix_caching=False)
    seq_on = [llm_out.token_ids for p in prompts for llm_out in on.generate([p], GREEDY, use_tqdm=False)]
    seq_off = [llm_out.token_ids for p in prompts for llm_out in off.generate([p], GREEDY, use_tqdm=False)]
    assert seq_on == seq_off
    batch = [o.token_ids for o in on.generate(prompts, GREEDY, use_tqdm=False)]  # warm, in one batch
    assert batch == seq_off
    assert on.engine.prefix_cache_stats()["restored_tokens"] > 0
    baseline(on)
    baseline(off)


@pytest.mark.parametrize("mode", ["after-prefill", "at-completion"])
def test_single_flight_identical_prompts(long_ctx_model, mode):
    llm = make(long_ctx_model, single_flight=mode)
    prompt = toks(100, offset=4)
    params = [GREEDY, SamplingParams(max_tokens=8, temperature=0.9, seed=1, ignore_eos=True),
              GREEDY, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)]
    outs = llm.generate([prompt] * 4, params, use_tqdm=False)
    restored = [o.num_cached_tokens for o in outs]
    assert restored == [0, 96, 96, 96]  # one computes the prompt; 3 restore its 6 full pages
    assert outs[2].token_ids == outs[0].token_ids and outs[3].token_ids == outs[0].token_ids[:5]
    assert len(outs[1].token_ids) == 8
    baseline(llm)


def test_single_flight_off_records_restores(long_ctx_model, capsys):
    for budget in (512, 64):
        llm = make(long_ctx_model, single_flight="off", max_num_batched_tokens=budget)
        outs = llm.generate([toks(100, offset=4)] * 4, GREEDY, use_tqdm=False)
        restored = [o.num_cached_tokens for o in outs]
        with capsys.disabled():
            print(f"\nsingle-flight off, incremental, budget {budget}: restored per request {restored}")
        assert len({tuple(o.token_ids) for o in outs}) == 1
        baseline(llm)


def test_abort_leader_mid_prefill_followers_complete(long_ctx_model):
    prompt = toks(120, offset=6)
    ref = make(long_ctx_model).generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    llm = make(long_ctx_model, max_num_batched_tokens=32)
    eng = llm.engine
    for i in range(3):
        eng.add_request(Request(f"r{i}", prompt, SamplingParams(**vars(GREEDY))))
    assert len(eng.held) == 2
    eng.step()
    assert 0 < eng.requests["r0"].num_computed_tokens < 120
    eng.abort("r0")
    assert eng.flights.role("r1") is Role.LEADER and list(eng.held) == ["r2"]
    outputs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert outputs == {"r1": ref, "r2": ref}
    baseline(llm)


def test_preempted_request_rehits_its_own_pages(long_ctx_model):
    prompts = [toks(60, offset=k) for k in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in make(long_ctx_model).generate(prompts, params, use_tqdm=False)]
    per_page = make(long_ctx_model).model.kv_bytes_per_token() * 16
    tight = make(long_ctx_model, kv_cache_memory=str(14 * per_page))
    assert [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.prefix_cache_stats()["restored_tokens"] > 0
    baseline(tight)


def test_lru_eviction_spares_referenced_pages():
    pool = BlockPool(4, 2)
    cache = PrefixCache(pool, "m")
    root = root_hash("m")
    seqs = [[1, 2], [3, 4], [5, 6]]
    pages = []
    for s in seqs:  # three single-page requests, published, then released in order
        page = pool.allocate(1)
        cache.publish(page[0], chain_hashes(root, s, 2)[0], s)
        pages.append(page)
    pool.free(pages[0])
    pool.free(pages[1])  # pages[2] stays referenced
    assert pool.num_free == 3 and cache.num_cached_pages == 3
    # Re-using [3, 4] makes it recently used: [1, 2] is now the least recently used.
    hit = cache.lookup(chain_hashes(root, [3, 4, 9], 2), [3, 4, 9])
    assert hit == pages[1]
    pool.free(hit)
    new = pool.allocate(2)  # one clean page, then one eviction
    assert pages[0][0] in new and cache.num_cached_pages == 2
    assert cache.lookup(chain_hashes(root, [1, 2, 0], 2), [1, 2, 0]) == []
    pool.allocate(1)  # evicts [3, 4]; [5, 6] is referenced and must survive
    assert cache.num_cached_pages == 1 and pool.num_free == 0
    assert cache.stats.evicted_tokens == 4


def test_hashes_are_deterministic_across_processes_and_salted():
    ids = list(range(40))
    here = [h.hex() for h in chain_hashes(root_hash("qwen2:x:1"), ids, 16)]
    code = ("from hetserve.kv.prefix_cache import chain_hashes, root_hash;"
            "print(','.join(h.hex() for h in chain_hashes(root_hash('qwen2:x:1'), list(range(40)), 16)))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert there.split(",") == here and len(here) == 2
    assert chain_hashes(root_hash("qwen2:x:1", "salt"), ids, 16)[0].hex() != here[0]


def test_salted_requests_do_not_share(long_ctx_model):
    llm = make(long_ctx_model)
    prompt = toks(70, offset=8)
    eng = llm.engine
    for rid, salt in (("a", "alice"), ("b", "bob"), ("c", "alice")):
        eng.add_request(Request(rid, prompt, SamplingParams(**vars(GREEDY)), cache_salt=salt))
        eng.run_until_done()
    assert eng.prefix_cache_stats()["restored_tokens"] == 64  # only alice's second request
    baseline(llm)


def test_flight_coordinator_rules():
    fc = FlightCoordinator("after-prefill")
    assert fc.add("a", ("p",)) and not fc.add("b", ("p",)) and fc.add("x", ("q",))
    assert fc.prefill_done("a") == ["b"]
    assert fc.add("c", ("p",))  # the flight closed: an identical newcomer starts a new flight
    assert fc.role("c") is Role.LEADER
    for rid in ("a", "b", "c", "x"):
        fc.end(rid, completed=True)
    with pytest.raises(KeyError, match="never tracked"):
        fc.end("zzz", completed=True)
    assert fc.num_tracked == 0
