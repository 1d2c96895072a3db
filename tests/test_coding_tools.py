"""The real coding tools against `hetserve serve` on the real Qwen2.5-Coder-0.5B, offline: Claude
Code (`claude -p`, the Anthropic Messages API, an 11.6k-token prompt of system text and tools)
and Codex CLI (`codex exec`, the Responses API with function tools) each complete one turn.

The two npm packages are installed at pinned versions under this test's own directory; without
npm, or where the registry cannot be reached, the tests skip and say why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import httpx
import pytest
from test_server import Server

pytestmark = pytest.mark.real_model

PACKAGES = ("@anthropic-ai/claude-code@2.1.332", "@openai/codex@0.171.0")
TURN_S = 900  # one turn's deadline: an 11.6k-token prefill on the slowest CPU, then a short answer


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the coding tools' tests need it (apt-get install npm)")
    d = tmp_path_factory.mktemp("coding-tools")
    r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(d), *PACKAGES],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"npm could not install {', '.join(PACKAGES)}: {(r.stderr or r.stdout).strip()[-300:]}")
    return d


@pytest.fixture(scope="module")
def server(real_05b):
    s = Server(real_05b, "--max-num-seqs", "2", "--api-key", "local-key")
    yield s
    assert s.stop() == 0


def test_claude_code_completes_a_turn(tools_dir, server, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "local-key",
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    r = subprocess.run([str(tools_dir / "node_modules/.bin/claude"), "-p", "What is 2 + 2? Answer with the number.",
                        "--model", "qwen2.5-coder-0.5b-instruct", "--output-format", "json"],
                       capture_output=True, text=True, timeout=TURN_S, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["is_error"] is False and out["result"].strip() and out["usage"]["input_tokens"] > 5000, out


def test_codex_completes_a_turn(tools_dir, server, tmp_path):
    home = tmp_path / "codex"
    home.mkdir()
    model = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer local-key"}).json()["data"][0]["id"]
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "local"\n\n[model_providers.local]\n'
        f'name = "hetserve"\nbase_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "HETSERVE_KEY"\n')
    env = {**os.environ, "HOME": str(tmp_path), "CODEX_HOME": str(home), "HETSERVE_KEY": "local-key"}
    r = subprocess.run([str(tools_dir / "node_modules/.bin/codex"), "exec", "--skip-git-repo-check",
                        "What is 2 + 2? Answer with the number."], capture_output=True, text=True, timeout=TURN_S,
                       env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.strip() and "tokens used" in r.stderr, r.stderr[-2000:]
