"""The web page at `/` in a real headless Chromium (Playwright): streaming chat with its stats line,
the dashboard's workers, routing decisions and a dead worker, the API-key prompt, a phone's width.

Needs the `playwright` package (dev extra) and a Chromium binary (Debian's `chromium`; Playwright's own
browser download is not used)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import httpx
import pytest
from test_server import Server, worker_pid

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"playwright is not installed ({e}); `make install` adds it", allow_module_level=True)

CHROMIUM = next((p for p in (os.environ.get("HETSERVE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                             shutil.which("chromium-browser")) if p and os.path.exists(p)), None)
if CHROMIUM is None:
    pytest.skip("no chromium binary (apt-get install chromium; or set HETSERVE_CHROMIUM)", allow_module_level=True)

WAIT = 60_000  # ms: only an upper bound (expectations return as soon as they hold), generous for a slow host


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = Server(tiny_qwen2, "--inference-device", "cpu:threads=1", "--inference-device", "cpu:threads=1",
               "--kv-cache-memory", "8MiB", "--no-startup-profile", "--worker-restarts", "0")
    yield s
    s.stop()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.set_default_timeout(WAIT)
    yield pg
    ctx.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def send(page, text: str) -> None:
    box = page.get_by_test_id("chat-input")
    box.click()
    box.type(text)
    box.press("Enter")


def test_the_page_loads_with_no_failed_request_and_no_console_error(server, browser):
    ctx = browser.new_context()
    pg = ctx.new_page()
    failed, console = [], []
    pg.on("requestfailed", lambda r: failed.append(f"{r.url}: {r.failure}"))
    pg.on("response", lambda r: r.status >= 400 and failed.append(f"{r.status} {r.url}"))
    pg.on("console", lambda m: m.type in ("error", "warning") and console.append(m.text))
    try:
        pg.goto(server.url + "/", wait_until="networkidle")
        expect(pg.get_by_test_id("model-name")).to_have_text("tiny-qwen2.gguf")
        pg.get_by_test_id("tab-dashboard").click()
        expect(pg.get_by_test_id("worker-card")).to_have_count(2)
        icon = pg.evaluate("""async () => { const r = await fetch(document.querySelector('link[rel="icon"]').href);
                                          return [r.status, r.headers.get('content-type')]; }""")
        assert icon == [200, "image/svg+xml"]
    finally:
        ctx.close()
    assert not failed and not console, (failed, console)


def test_chat_streams_an_answer_with_its_stats(server, page):
    page.goto(server.url + "/")
    expect(page.get_by_test_id("model-name")).to_have_text("tiny-qwen2.gguf")
    page.get_by_text("System prompt and sampling").click()
    page.get_by_test_id("system-prompt").fill("You are terse.")
    page.get_by_test_id("max-tokens").fill("24")
    page.get_by_test_id("seed").fill("7")
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions")
            else None)

    send(page, "Write hello world")
    answer = page.get_by_test_id("msg-assistant").last
    stats = answer.get_by_test_id("msg-stats")
    expect(stats.locator('[data-stat="worker"]')).to_contain_text("worker cpu")
    expect(stats.locator('[data-stat="ttft"]')).to_contain_text("TTFT")
    expect(stats.locator('[data-stat="toks"]')).to_contain_text("tok/s")
    expect(stats.locator('[data-stat="cached"]')).to_contain_text("cached prompt tokens")
    assert answer.get_by_test_id("msg-content").inner_text().strip()
    assert page.get_by_test_id("msg-user").first.inner_text().endswith("Write hello world")
    b = bodies[0]
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["messages"] == [{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": "Write hello world"}]
    assert b["max_tokens"] == 24 and b["seed"] == 7 and b["temperature"] == 0.7 and b["model"] == "tiny-qwen2.gguf"

    # Multi-turn: the history goes back; Regenerate re-runs the last answer in place.
    send(page, "And in C?")
    expect(page.get_by_test_id("msg-assistant")).to_have_count(2)
    expect(page.get_by_test_id("msg-assistant").last.locator('[data-stat="worker"]')).to_be_visible()
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user", "assistant", "user"]
    page.get_by_test_id("regenerate").click()
    expect(page.get_by_test_id("stop")).to_be_disabled()
    expect(page.get_by_test_id("msg-assistant")).to_have_count(2)
    assert len(bodies) == 3 and bodies[2]["messages"] == bodies[1]["messages"]

    # Kept in localStorage: there after a reload; a new conversation, then deleting it.
    page.reload()
    expect(page.get_by_test_id("msg-assistant")).to_have_count(2)
    expect(page.get_by_test_id("conv-item")).to_have_count(1)
    expect(page.get_by_test_id("conv-item")).to_contain_text("Write hello world")
    page.get_by_test_id("new-conv").click()
    expect(page.get_by_test_id("conv-item")).to_have_count(2)
    expect(page.get_by_test_id("msg-assistant")).to_have_count(0)
    page.get_by_test_id("conv-delete").first.click()
    expect(page.get_by_test_id("conv-item")).to_have_count(1)
    expect(page.get_by_test_id("msg-assistant")).to_have_count(2)


def test_stop_aborts_the_request(server, page):
    """Stop aborts the fetch: here one that the server never answers (held by the test), so the
    click always lands while the request is in flight."""
    page.goto(server.url + "/")
    page.route("**/v1/chat/completions", lambda route: None)  # never continued: pending until aborted
    send(page, "count to a thousand")
    expect(page.get_by_test_id("stop")).to_be_enabled()
    expect(page.get_by_test_id("send")).to_be_disabled()
    stats = page.get_by_test_id("msg-assistant").last.get_by_test_id("msg-stats")
    before = stats.bounding_box()["height"]
    page.get_by_test_id("stop").click()
    expect(stats.locator('[data-stat="finish"]')).to_have_text("stopped")
    assert stats.bounding_box()["height"] == before  # the stats line's height is reserved: nothing moves
    expect(page.get_by_test_id("send")).to_be_enabled()
    expect(page.get_by_test_id("regenerate")).to_be_enabled()


def sse(*events) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_stats_line_and_errors_from_the_stream(server, page):
    """The `hetserve` extension's speculative and disaggregated fields, an error event mid-stream
    and an HTTP error (canned responses: the tiny server runs neither speculation nor a split)."""
    page.goto(server.url + "/")
    replies = [
        sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
             "hetserve": {"worker": "cpu1", "cached_tokens": 3, "spec": {"proposed": 8, "accepted": 6},
                          "disaggregated": {"prefill": "cpu0", "decode": "cpu1"}}},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                      "prompt_tokens_details": {"cached_tokens": 3}}}),
        sse({"choices": [{"index": 0, "delta": {"content": "part"}, "finish_reason": None}]},
            {"error": {"message": "worker cpu1 died", "type": "server_error", "param": None, "code": None}}),
    ]

    def reply(route):
        if replies:
            route.fulfill(status=200, content_type="text/event-stream", body=replies.pop(0))
        else:
            route.fulfill(status=400, content_type="application/json",
                          body=json.dumps({"error": {"message": "max_tokens is too large", "type": "x"}}))

    page.route("**/v1/chat/completions", reply)
    send(page, "one")
    stats = page.get_by_test_id("msg-assistant").last.get_by_test_id("msg-stats")
    expect(stats.locator('[data-stat="spec"]')).to_have_text("spec 75.0% accepted (6/8)")
    expect(stats.locator('[data-stat="disagg"]')).to_have_text("prefill cpu0 → decode cpu1")
    expect(stats.locator('[data-stat="worker"]')).to_have_text("worker cpu1")
    expect(stats.locator('[data-stat="cached"]')).to_have_text("3 cached prompt tokens")
    send(page, "two")
    last = page.get_by_test_id("msg-assistant").last
    expect(last.get_by_test_id("msg-error")).to_have_text("Error: worker cpu1 died")
    expect(last.get_by_test_id("msg-content")).to_have_text("part")
    send(page, "three")
    expect(page.get_by_test_id("msg-assistant").last.get_by_test_id("msg-error")) \
        .to_have_text("Error: max_tokens is too large")


def test_model_text_is_escaped_and_fences_are_code(server, page):
    conv = {"id": "x1", "title": "escape", "system": "", "updated": 0, "messages": [
        {"role": "user", "content": "<b>bold?</b>"},
        {"role": "assistant", "content": "Here:\n```python\nprint('<img src=x onerror=alert(1)>')\n```\n<i>done</i>",
         "stats": {"worker": "cpu0"}}]}
    page.add_init_script(f"localStorage.setItem('hetserve.conversations', {json.dumps(json.dumps([conv]))});"
                         "localStorage.setItem('hetserve.current', '\"x1\"');")
    page.goto(server.url + "/")
    msg = page.get_by_test_id("msg-assistant")
    expect(msg.locator("pre code")).to_have_text("print('<img src=x onerror=alert(1)>')")
    expect(msg.locator("pre")).to_have_attribute("data-lang", "python")
    assert page.locator("#messages img, #messages b, #messages i").count() == 0
    expect(msg.get_by_test_id("msg-content")).to_contain_text("<i>done</i>")
    expect(page.get_by_test_id("msg-user")).to_contain_text("<b>bold?</b>")


def test_dashboard_shows_workers_and_routing(server, page):
    httpx.post(server.url + "/v1/chat/completions", timeout=60,
               json={"messages": [{"role": "user", "content": "route me"}], "max_tokens": 4})
    page.goto(server.url + "/")
    page.get_by_test_id("tab-dashboard").click()
    for name in ("cpu0", "cpu1"):
        card = page.locator(f'[data-testid="worker-card"][data-worker="{name}"]')
        expect(card.get_by_test_id("worker-state")).to_have_text("up")
        expect(card.locator('[data-field="kv"]')).to_contain_text("/")
    route = page.get_by_test_id("route").first
    expect(route).to_be_visible()
    cands = route.get_by_test_id("route-candidates")
    expect(cands.locator("tbody tr")).to_have_count(2)
    chosen = cands.locator('tr[data-chosen="true"]')
    expect(chosen).to_have_count(1)
    expect(route.get_by_test_id("route-choice")).to_have_text(chosen.get_attribute("data-worker"))
    assert cands.locator("thead th").count() >= 2  # the worker and at least one numeric field
    expect(page.get_by_test_id("latency-summary")).to_contain_text("TTFT")
    # Polled once a second: a new request shows up without a reload.
    first_id = route.get_attribute("data-request-id")
    httpx.post(server.url + "/v1/chat/completions", timeout=60,
               json={"messages": [{"role": "user", "content": "again"}], "max_tokens": 2})
    expect(page.get_by_test_id("route").first).not_to_have_attribute("data-request-id", first_id)
    # Keyboard: arrows move between the tabs.
    page.get_by_test_id("tab-dashboard").focus()
    page.keyboard.press("ArrowLeft")
    expect(page.get_by_test_id("view-chat")).to_be_visible()
    expect(page.get_by_test_id("tab-chat")).to_be_focused()
    page.keyboard.press("ArrowRight")
    expect(page.get_by_test_id("view-dashboard")).to_be_visible()


def test_dashboard_renders_speculation_splits_and_transfers(server, page):
    """Fields the tiny two-worker server does not produce, from a canned /v1/dashboard body."""
    cand = {"active": 0, "queued": 1, "cached_tokens": 0, "score": 0.5}
    body = {"model": "m", "time": 1e9, "route_policy": "cost", "workers": [
        {"name": "gpu0", "device": "cuda:0", "state": "up", "running": 2, "waiting": 1, "kv_pages_used": 30,
         "kv_pages_total": 40, "preemptions": 3, "prefix_cache": {"hit_rate": 0.25}, "decode_tok_s": 80.5,
         "prefill_tok_s": 900.0, "spec": {"acceptance_rate": 0.75, "mean_k": 3.5},
         "profile": {"device": "cuda:0", "prefill": [[128, 5000.0], [512, 9000.0]], "decode": [[1, 90.0]]}},
        {"name": "cpu0", "device": "cpu", "state": "dead", "reason": "worker cpu0 died (exit code -9)", "running": 0,
         "waiting": 0, "kv_pages_used": 0, "kv_pages_total": 10, "preemptions": 0, "prefix_cache": {"hit_rate": None},
         "decode_tok_s": 0, "prefill_tok_s": 0, "spec": None, "profile": None}],
        "routes": [
            {"time": 1e9, "request_id": "r1", "event": "kv_transfer", "prefill": "gpu0", "decode": "cpu0", "ok": True,
             "error": None, "bytes": 4096, "transfer_s": 0.01},
            {"time": 1e9, "request_id": "r1", "prompt_tokens": 900, "max_tokens": 64, "policy": "cost",
             "choice": "gpu0", "candidates": [{"worker": "gpu0", **cand}, {"worker": "cpu0", **cand, "score": 2.0}],
             "split": {"prefill": "gpu0", "decode": "cpu0", "transfer_s": 0.01, "score": 0.4, "best_whole": 0.5}}],
        "latency": {"window_s": 300, "ttft": {"p50": 0.05, "p90": 0.08, "p99": 0.1},
                    "itl": {"p50": 0.01, "p90": 0.02, "p99": 0.03},
                    "series": [{"t": 1e9 + 10 * i, "ttft_p50": 0.05, "ttft_p99": 0.1 + i / 100, "itl_p50": 0.01,
                                "itl_p99": 0.03} for i in range(4)]}}
    page.route("**/v1/dashboard", lambda route: route.fulfill(status=200, content_type="application/json",
                                                                body=json.dumps(body)))
    page.goto(server.url + "/#dashboard")
    gpu = page.locator('[data-testid="worker-card"][data-worker="gpu0"]')
    expect(gpu.locator('[data-field="spec-acc"]')).to_have_text("75.0%")
    expect(gpu.locator('[data-field="spec-k"]')).to_have_text("3.50")
    expect(gpu.locator('[data-field="hit"]')).to_have_text("25.0%")
    expect(gpu.locator('[data-field="kv"]')).to_have_text("30 / 40")
    expect(gpu.locator(".bar")).to_have_attribute("aria-valuenow", "30")
    expect(gpu.locator('[data-field="preemptions"]')).to_have_text("3")
    expect(gpu.locator(".profile tbody tr")).to_have_count(3)
    cpu = page.locator('[data-testid="worker-card"][data-worker="cpu0"]')
    expect(cpu.get_by_test_id("worker-reason")).to_have_text("dead: worker cpu0 died (exit code -9)")
    expect(page.get_by_test_id("route-split")).to_contain_text("split: prefill gpu0 → decode cpu0")
    expect(page.get_by_test_id("route-split")).to_contain_text("best whole 0.5")
    expect(page.locator('[data-testid="route-candidates"] tr[data-chosen="true"]')).to_have_attribute(
        "data-worker", "gpu0")
    expect(page.get_by_test_id("route-event")).to_contain_text("KV transfer gpu0 → cpu0")
    expect(page.get_by_test_id("route-event")).to_contain_text("bytes 4096")
    expect(page.get_by_test_id("latency-summary")).to_contain_text("p99 100 ms")
    drawn = page.evaluate("""() => { const c = document.getElementById('latency-chart');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }""")
    assert drawn > 500  # the chart's lines are there


def test_phone_width_has_no_horizontal_scroll(server, browser):
    ctx = browser.new_context(viewport={"width": 360, "height": 740}, is_mobile=True, has_touch=True)
    pg = ctx.new_page()
    pg.set_default_timeout(WAIT)
    long = "x" * 300
    conv = {"id": "n1", "title": long, "system": "", "updated": 0, "messages": [
        {"role": "user", "content": long},
        {"role": "assistant", "content": f"```\n{'y' * 300}\n```\n{long}",
         "stats": {"worker": "cpu0", "ttft": 0.01, "tok_s": 50, "cached_tokens": 0,
                   "disaggregated": {"prefill": "cpu0", "decode": "cpu1"}}}]}
    pg.add_init_script(f"localStorage.setItem('hetserve.conversations', {json.dumps(json.dumps([conv]))});"
                       "localStorage.setItem('hetserve.current', '\"n1\"');")
    try:
        no_scroll = "document.documentElement.scrollWidth <= window.innerWidth"
        pg.goto(server.url + "/")
        expect(pg.get_by_test_id("msg-assistant")).to_be_visible()
        assert pg.evaluate(no_scroll)
        pg.get_by_text("System prompt and sampling").click()
        assert pg.evaluate(no_scroll)
        expect(pg.get_by_test_id("chat-input")).to_be_in_viewport()  # sticks to the bottom of the screen
        expect(pg.get_by_test_id("send")).to_be_in_viewport()
        pg.get_by_test_id("tab-dashboard").click()
        expect(pg.locator('[data-testid="worker-card"]')).to_have_count(2)
        expect(pg.get_by_test_id("route").first).to_be_visible()
        assert pg.evaluate(no_scroll)
    finally:
        ctx.close()


def test_dead_worker_is_shown_dead(server, page):
    page.goto(server.url + "/#dashboard")
    card = page.locator('[data-testid="worker-card"][data-worker="cpu1"]')
    expect(card.get_by_test_id("worker-state")).to_have_text("up")
    os.kill(worker_pid(server, "cpu1"), signal.SIGKILL)
    expect(card.get_by_test_id("worker-state")).to_have_text("dead")
    expect(card).to_have_attribute("data-state", "dead")
    expect(card.get_by_test_id("worker-reason")).to_be_visible()
    expect(card.get_by_test_id("worker-reason")).to_contain_text("dead")
    expect(page.locator('[data-testid="worker-card"][data-worker="cpu0"]').get_by_test_id("worker-state")) \
        .to_have_text("up")


def test_api_key_prompt(tiny_qwen2, page):
    s = Server(tiny_qwen2, "--kv-cache-memory", "8MiB", "--no-startup-profile", "--api-key", "secret")
    try:
        page.goto(s.url + "/")
        err = page.get_by_test_id("auth-error")
        expect(err).to_be_visible()
        expect(err).to_contain_text("API key")
        expect(page.get_by_test_id("api-key")).to_be_focused()
        expect(page.get_by_test_id("chat-input")).to_be_visible()  # the page itself is there, not blank

        page.get_by_test_id("api-key").fill("wrong")
        page.get_by_test_id("api-key").press("Enter")
        expect(err).to_be_visible()
        expect(err).to_contain_text("refused")

        page.get_by_test_id("api-key").fill("secret")
        page.get_by_test_id("key-save").click()
        expect(page.get_by_test_id("auth")).to_be_hidden()
        expect(page.get_by_test_id("model-name")).to_have_text("tiny-qwen2.gguf")
        page.get_by_text("System prompt and sampling").click()
        page.get_by_test_id("max-tokens").fill("8")
        send(page, "hi")
        expect(page.get_by_test_id("msg-assistant").last.locator('[data-stat="worker"]')).to_contain_text("cpu")
        page.get_by_test_id("tab-dashboard").click()
        expect(page.get_by_test_id("worker-card")).to_have_count(1)
        assert page.evaluate("localStorage.getItem('hetserve.apiKey')") == "secret"
    finally:
        s.stop()
