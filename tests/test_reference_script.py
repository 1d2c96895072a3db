"""scripts/make_reference.py still reproduces tests/data/qwen05_reference.json (opt-in: ~3 min)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.reference
@pytest.mark.skipif(os.environ.get("HETSERVE_CHECK_REFERENCE") != "1",
                    reason="loads HF transformers on the real model; set HETSERVE_CHECK_REFERENCE=1")
def test_reference_script_reproduces_stored_outputs(tmp_path, real_05b, reference):
    out = tmp_path / "ref.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_reference.py"), "--gguf", real_05b,
                    "--out", str(out)], check=True, timeout=1800)
    fresh = json.loads(out.read_text())
    for a, b in zip(fresh["cases"], reference["cases"]):
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["greedy_token_ids"] == b["greedy_token_ids"]
        assert a["tf_top_ids"] == b["tf_top_ids"]
    assert fresh["chats"] == reference["chats"]
    assert fresh["tokenizer"] == reference["tokenizer"]
