"""scripts/long_context_needle.py: the prompt it builds (its length, the fact where asked, the
question under the chat template) and, on the real 0.5B, the fact found in a short context."""

from __future__ import annotations

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def needle():
    return load_script("long_context_needle")


def _find(ids: list[int], part: list[int]) -> int:
    return next(i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part)


def test_the_prompt_has_the_length_asked_and_the_fact_at_its_depth(needle, tiny_qwen2):
    from hetserve import LLM

    llm = LLM(model=tiny_qwen2, kv_cache_memory="4MiB")
    for tokens, depth in ((600, 100), (1500, 1000)):
        ids = needle.build_prompt(llm, tokens, depth)
        assert len(ids) == tokens
        text = llm.tokenizer.decode(ids, skip_special_tokens=False)
        assert text.count(needle.FACT) == 1 and text.endswith("<|im_start|>assistant\n")
        assert needle.QUESTION in text[text.index(needle.FACT):]
        pre = llm.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "@@SOURCE@@"}]).split("@@SOURCE@@")[0])
        assert _find(ids, llm.encode(needle.NOTE)) == len(pre) + depth


def test_the_real_model_finds_the_fact(needle, real_05b):
    from hetserve import LLM

    result = needle.run(LLM(model=real_05b, kv_cache_memory="256MiB"), 1200, depth=300)
    assert result["prompt_tokens"] == 1200
    assert result["found"], result["answer"]
