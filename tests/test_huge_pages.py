"""Weights on transparent huge pages: the arena's copies equal the tensors, the kernel backs them
with 2 MiB pages where THP allows, and an engine's output does not depend on where its weights are."""

import gc

import pytest
import torch

from hetserve.layers import huge_pages
from hetserve.layers.huge_pages import HUGE_PAGE, HugePageArena, huge_page_bytes, thp_mode


def test_arena_copies_keep_values_dtype_shape_and_alignment():
    arena = HugePageArena(chunk=HUGE_PAGE)
    tensors = [torch.randn(7, 33), torch.randint(0, 255, (1000,), dtype=torch.uint8),
               torch.randn(3).half(), torch.randn(600, 1024), torch.empty(0)]  # the 4th (2.4 MB) needs a new chunk
    placed = [arena.place(t) for t in tensors]
    for t, p in zip(tensors, placed):
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous()
        assert torch.equal(p, t)
        assert t.numel() == 0 or (p.data_ptr() != t.data_ptr() and p.data_ptr() % 64 == 0)
    assert len(arena._buffers) == 2
    ends = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in placed if p.numel())
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no two copies overlap


def test_thp_mode_reads_the_bracketed_choice(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP", f)
    assert thp_mode() == "madvise"
    f.write_text("always madvise [never]\n")
    assert thp_mode() == "never" and HugePageArena.if_supported() is None
    monkeypatch.setattr(huge_pages, "_THP", tmp_path / "absent")
    assert thp_mode() is None and HugePageArena.if_supported() is None


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages off here ({thp_mode()})")
def test_placed_tensors_land_on_huge_pages():
    arena = HugePageArena.if_supported()
    assert arena is not None
    src = torch.ones(16 << 20, dtype=torch.uint8)  # 16 MiB: eight huge pages' worth
    gc.collect()
    gc.disable()  # nothing else in this process is freed while the mapping is read
    try:
        arena._new_chunk(src.numel())  # mapped and advised, not yet written
        before = huge_page_bytes(arena._free[0])
        t = arena.place(src)
        after = huge_page_bytes(t)
    finally:
        gc.enable()
    assert arena.advised >= 16 << 20
    # The kernel may fail to find a free 2 MiB page now and then, but not for all eight.
    assert after - before >= HUGE_PAGE
    assert int(t.sum()) == 16 << 20


def test_engine_output_does_not_depend_on_huge_pages(tiny_qwen2):
    from hetserve.llm import LLM
    from hetserve.sampling_params import SamplingParams

    moved = HugePageArena.if_supported() is not None
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs, logprobs = [], []
    for on in (True, False):
        llm = LLM(model=tiny_qwen2, kv_cache_memory="4MiB", huge_pages=on)
        q = llm.model.layers[0].gate_up.qweight.q
        # Moved weights are views into an arena chunk; the loader's own tensors fill their storage.
        assert (q.untyped_storage().nbytes() > q.numel()) == (on and moved)
        outs.append([o.token_ids for o in llm.generate(["def add(a, b):", "Hello"], greedy, use_tqdm=False)])
        logprobs.append(llm.token_logprobs("The quick brown fox jumps over the lazy dog."))
    assert outs[0] == outs[1]
    assert torch.equal(torch.as_tensor(logprobs[0]), torch.as_tensor(logprobs[1]))
