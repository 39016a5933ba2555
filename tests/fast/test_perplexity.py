"""`python -m fast.perplexity`: llama-perplexity's contract (chunks of -c, second halves scored, the final line)."""

import re
import subprocess
import sys

import numpy as np
import pytest

import ref
from fast.perplexity import estimate
from ref.profile import corpus_tokens
from tests.helpers import ROOT, SHIPPED


def run(*args):
    return subprocess.run([sys.executable, "-m", "fast.perplexity", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = tmp_path_factory.mktemp("ppl") / "t.txt"
    f.write_text((SHIPPED.parent / "corpus" / "val.txt").read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return f


def test_matches_ref_scored_the_same_way(text):
    """Chunks of 64 from the document stream, BOS first, the last 32 tokens of each scored: ref's NLLs give the
    same final line."""
    r = run("-f", text, "-c", "64", "--chunks", "3", "--dense")
    assert r.returncode == 0, r.stderr
    ppl, unc = map(float, re.fullmatch(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", r.stdout.splitlines()[-1]).groups())
    assert r.stdout.startswith("[1]") and "[3]" in r.stdout
    m, tok = ref.load_model(SHIPPED), ref.load_tokenizer(SHIPPED)
    stream = np.array([i for ids, _ in corpus_tokens(tok, text) for i in ids])
    nll = []
    for c in range(3):
        ids = stream[c * 64:(c + 1) * 64].copy()
        ids[0] = tok.bos_id
        logits = m.logits(ids).astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
        nll += [-logp[j - 1, ids[j]] for j in range(32, 64)]
    want = estimate(np.array(nll))
    assert ppl == pytest.approx(want[0], rel=1e-4) and unc == pytest.approx(want[1], rel=1e-3)


@pytest.mark.parametrize("args, expect", [
    (["-c", "4096"], "-c/--ctx-size must be in [2, 512]"),
    (["-c", "5000000"], "-c/--ctx-size must be in"),
    (["-f", "/nonexistent.txt"], "-f/--file /nonexistent.txt: no such file"),
    (["--dense", "--predictors", "x"], "--dense and --predictors contradict each other"),
])
def test_bad_flags(text, args, expect):
    r = run(*(["-f", text] if "-f" not in args else []), *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr and expect in r.stderr and r.stderr.count("\n") == 1


def test_text_too_short_for_the_context(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("once upon a time there was a cat.")
    r = run("-f", f, "-c", "64")
    assert r.returncode == 1 and "needs at least 128" in r.stderr
