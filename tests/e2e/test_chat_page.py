"""The chat page at / in a real headless browser (Debian's chromium, driven by Playwright): type a message, see the
streamed answer, take a screenshot. Skipped where chromium or Playwright is not installed (apt-get install chromium;
pip install playwright: it drives /usr/bin/chromium, nothing is downloaded)."""

import os
import shutil

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary")

from tests.e2e.server import ServerProcess  # noqa: E402

# Flags that keep Chromium off this machine's closed network (env/machines/python.md).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def test_type_a_message_and_see_the_streamed_answer(tmp_path):
    server = ServerProcess("-np", "2")
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent === 'tiny-relu-llama'")
            page.click("summary")  # the settings
            page.fill("#max_tokens", "24")
            page.fill("#temperature", "0")
            page.fill("#input", "Tell me a story about a cat.")
            page.press("#input", "Enter")
            page.wait_for_selector(".assistant .stats", timeout=60000)  # the last chunk's timings: the stream ended
            answer = page.inner_text(".assistant")
            user = page.inner_text(".user")
            shot = tmp_path / "chat.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        assert user == "Tell me a story about a cat."
        assert "tokens" in answer and "tok/s" in answer and len(answer.split("\n")[0]) > 0
        assert shot.stat().st_size > 5000
        if os.environ.get("CHAT_SCREENSHOT"):  # keep it for a look: CHAT_SCREENSHOT=/path/chat.png
            shutil.copy(shot, os.environ["CHAT_SCREENSHOT"])
    finally:
        server.stop()
