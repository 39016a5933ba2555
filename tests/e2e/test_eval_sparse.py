"""scripts/eval_sparse.py on the shipped model and a few sentences: its table, JSON and --type."""

import json

from click.testing import CliRunner

from tests.helpers import SHIPPED, load_script

TEXT = "once upon a time there was a little cat. the cat liked to play with a red ball.\n" * 8


def test_eval_sparse_at_a_format(tmp_path):
    (tmp_path / "val.txt").write_text(TEXT)
    r = CliRunner().invoke(load_script("eval_sparse").main, [str(SHIPPED), "--corpus", str(tmp_path), "--type", "q8_0",
                                                             "--window", "64", "--json", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "e.json").read_text())
    assert out["type"] == "q8_0" and out["tokens"] > 100 and len(out["layers"]) == 6
    assert 1 < out["perplexity"]["dense"] < 100 and "weights q8_0" in r.output


def test_eval_sparse_unknown_type(tmp_path):
    (tmp_path / "val.txt").write_text(TEXT)
    r = CliRunner().invoke(load_script("eval_sparse").main, [str(SHIPPED), "--corpus", str(tmp_path), "--type", "q3_k"])
    assert r.exit_code == 1 and "--type: unknown format 'q3_k' (known: f32, f16, bf16, q8_0, q4_0)" in r.output
