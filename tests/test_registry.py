"""Model registry: cache location, verification, re-pull of a corrupted file, clear errors."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from hetserve.models import registry

NAME = "qwen2.5-coder-0.5b-instruct"


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("HETSERVE_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert registry.cache_dir() == tmp_path / "hf" / "hetserve"
    monkeypatch.setenv("HETSERVE_CACHE", str(tmp_path / "mine"))
    assert registry.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("HETSERVE_CACHE")
    monkeypatch.delenv("HF_HOME")
    assert registry.cache_dir() == registry.Path.home() / ".cache" / "huggingface" / "hetserve"


def test_unknown_name_and_missing_path_are_clear(tmp_path):
    with pytest.raises(registry.ModelNotFound, match="unknown model 'no-such-model'.*qwen2.5-coder-0.5b"):
        registry.resolve("no-such-model")
    with pytest.raises(registry.ModelNotFound, match="no such GGUF file"):
        registry.resolve(str(tmp_path / "missing.gguf"))


def test_uncached_model_without_pull_says_what_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("HETSERVE_CACHE", str(tmp_path))
    with pytest.raises(registry.ModelNotFound, match=f"run: hetserve pull {NAME}"):
        registry.resolve(NAME, auto_pull=False)


@pytest.mark.real_model
def test_corrupted_cache_is_detected_and_pulled_again(monkeypatch, tmp_path, real_05b):
    monkeypatch.setenv("HETSERVE_CACHE", str(tmp_path))
    dest = tmp_path / registry.MODELS[NAME].filename
    shutil.copyfile(real_05b, dest)
    # First use verifies the full sha256 once; afterwards the cached file is trusted by its marker.
    assert registry.pull(NAME, progress=False) == dest
    with monkeypatch.context() as m:  # trusted means not hashed at all (a fast disk hashes quickly too)
        m.setattr(registry, "sha256_file", lambda *a, **k: pytest.fail("hashed a file its marker vouches for"))
        assert registry.resolve(NAME, auto_pull=False) == dest
    # Flip one byte in the middle of the weights.
    with open(dest, "r+b") as f:
        f.seek(300_000_000)
        b = f.read(1)
        f.seek(300_000_000)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(dest, ns=(time.time_ns(), time.time_ns()))
    with pytest.raises(registry.ModelNotFound, match=r"sha256 .* \(corrupt\).*hetserve pull"):
        registry.resolve(NAME, auto_pull=False)
    # Truncation is reported by size before any hashing.
    assert "truncated" in registry.verify(registry.MODELS[NAME], _truncated_copy(dest, tmp_path))
    # pull() notices the bad file and fetches the parts again.
    assert registry.pull(NAME, progress=False) == dest
    assert registry.verify(registry.MODELS[NAME], dest) is None


def _truncated_copy(src, tmp_path):
    out = tmp_path / "short.gguf"
    with open(src, "rb") as f, open(out, "wb") as g:
        g.write(f.read(1_000_000))
    return out
