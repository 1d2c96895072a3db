"""Shared fixtures: tiny random GGUF models (written here) and the real 0.5B model (pulled once)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import write_tiny_gguf  # noqa: E402

DATA = Path(__file__).parent / "data"
REAL_05B = "qwen2.5-coder-0.5b-instruct"
SCRIPTS = Path(__file__).parent.parent / "scripts"


def load_script(name: str):
    """scripts/<name>.py imported as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def attention_split(mod, tokens: int | None):
    """A native module's decode attention splitting rows past `tokens` into segments (None: as it
    is), restored after."""
    before = mod.attention_split()
    if tokens is not None:
        mod.set_attention_split(tokens)
    try:
        yield
    finally:
        mod.set_attention_split(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(d / "tiny-qwen2.gguf", "qwen2")
    write_tiny_gguf(d / "tiny-llama.gguf", "llama", tied=True)
    return d


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_dir) -> str:
    return str(tiny_dir / "tiny-qwen2.gguf")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir) -> str:
    return str(tiny_dir / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_kquants(tiny_dir) -> str:
    """A tiny qwen2 whose layers' matrices are Q5_K, Q5_1 and Q4_1 in turn (widths of 256 and 512,
    as Q5_K's super-blocks need): the `gguf` format's q5_1 and int4 kernels on a file's blocks."""
    path = tiny_dir / "tiny-kquants.gguf"
    if not path.exists():
        write_tiny_gguf(path, "qwen2", hidden=256, ffn=512, n_heads=4, n_kv_heads=2, qtypes=("Q5_K", "Q5_1", "Q4_1"))
    return str(path)


@pytest.fixture(scope="session")
def real_05b() -> str:
    """Path of the real Qwen2.5-Coder-0.5B GGUF: pulled into the cache on first use, then reused."""
    from hetserve.models import registry

    return str(registry.resolve(REAL_05B))


@pytest.fixture(scope="session")
def reference() -> dict:
    with open(DATA / "qwen05_reference.json") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def real_llm(real_05b):
    from hetserve import LLM

    return LLM(model=real_05b, kv_cache_memory="512MiB", weight_format="fp32")  # the reference is fp32
