"""A seeded fuzz of the tiny models' header bytes (metadata and tensor infos) through the whole
load: every file either loads and generates, or fails with one of the ValueErrors the command line
and the server print as one line (GGUFError, ModelConfigError, TokenizerError, ...). Never another
exception, never an allocation a field alone sized (the process's address space is capped)."""

from __future__ import annotations

import random
import resource

import pytest

from hetserve import LLM, SamplingParams
from hetserve.models.gguf_loader import GGUFFile


@pytest.mark.parametrize("name", ["tiny-qwen2.gguf", "tiny-llama.gguf"])
def test_fuzzed_headers_load_or_give_a_clear_error(tiny_dir, tmp_path, name):
    data = (tiny_dir / name).read_bytes()
    with GGUFFile(tiny_dir / name) as f:
        header_end = min(t.offset for t in f.tensors.values())
    rng = random.Random(2026)
    outcomes: dict[str, int] = {}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    in_use = int(status["VmSize"].split()[0]) << 10
    resource.setrlimit(resource.RLIMIT_AS, (in_use + (4 << 30), hard))  # far below a field's worst
    try:
        for trial in range(120):
            d = bytearray(data)
            for _ in range(rng.choice([1, 1, 2, 4, 8])):
                i = rng.randrange(24, header_end)  # past the magic, version and counts
                d[i] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256), d[i] ^ (1 << rng.randrange(8))])
            path = tmp_path / f"{trial}.gguf"
            path.write_bytes(d)
            try:
                with LLM(str(path), kv_cache_memory="8MiB") as llm:
                    llm.generate(["def add(a, b):"], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
                kind = "loaded"
            except ValueError as e:
                kind = type(e).__name__
            except Exception as e:  # noqa: BLE001 - the finding this test exists for
                pytest.fail(f"trial {trial}: {type(e).__name__}: {e}")
            outcomes[kind] = outcomes.get(kind, 0) + 1
            path.unlink()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert outcomes.get("loaded", 0) >= 5 and outcomes.get("GGUFError", 0) >= 50, outcomes
