"""README's code blocks as a user pastes them: every ```bash and ```python block runs, unless a comment just above it
says why not (`<!-- untested: ... -->`: it installs, serves, or takes minutes); usage synopses are ```text blocks."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

BLOCK = re.compile(r"(<!-- untested: [^>]+ -->\n)?```(\w*)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str, str]]:
    return BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8"))


RUNNABLE = [(lang, code) for marker, lang, code in blocks() if lang in ("bash", "python") and not marker]


def test_readme_is_one_page_whose_links_lead_somewhere():
    """A user's page (300 lines at most: the rest lives in docs/), every relative link to a file that exists."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#:]+)\)", text)
    assert len(links) >= 4 and [link for link in links if not (ROOT / link).exists()] == []


def test_every_block_is_runnable_text_or_says_why_not():
    assert {lang for _, lang, _ in blocks()} <= {"bash", "python", "text"}
    assert len(RUNNABLE) >= 4  # generate, Python, convert, perplexity


@pytest.mark.parametrize("lang, code", RUNNABLE, ids=[code.splitlines()[0][:60] for _, code in RUNNABLE])
def test_readme_block_runs_as_pasted(lang, code, tmp_path):
    """In a folder of its own (the files a block writes stay there) that sees the repository's data/ and scripts/ as
    README's commands do from the repository root; .venv/bin/python is this interpreter."""
    (tmp_path / "data").symlink_to(ROOT / "data")
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if lang == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code.replace(".venv/bin/python", sys.executable)]
    else:
        cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
