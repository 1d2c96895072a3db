"""Screenshots of the web page for docs/server.md (docs/img/chat.png, docs/img/dashboard.png).

Starts `hetserve serve` with the real 0.5B model on two workers, asks one question through the
page in Debian's chromium (driven by Playwright), sends a few more requests, and captures the
chat and the dashboard. Usage: .venv/bin/python scripts/web_screenshots.py [MODEL]
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import expect, sync_playwright

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "hetserve.cli", "serve", "--model", model, "--port", str(port),
                             "--inference-device", "cpu:threads=1", "--inference-device", "cpu:threads=1",
                             "--kv-cache-memory", "256MiB"])
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.set_default_timeout(300_000)
            page.goto(url + "/")
            box = page.get_by_test_id("chat-input")
            box.click()
            box.type("Write a Python function that reverses a string.")
            box.press("Enter")
            expect(page.get_by_test_id("msg-assistant").last.locator('[data-stat="worker"]')).to_be_visible()
            page.evaluate("document.activeElement.blur()")
            page.screenshot(path=str(IMG / "chat.png"), full_page=True)
            for q in ("def fib(n):", "Explain list comprehensions in one sentence.", "def fib(n):"):
                httpx.post(url + "/v1/chat/completions", timeout=300,
                           json={"messages": [{"role": "user", "content": q}], "max_tokens": 24})
            page.get_by_test_id("tab-dashboard").click()
            page.wait_for_timeout(2500)
            page.screenshot(path=str(IMG / "dashboard.png"), full_page=True)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
