"""`python -m ref` as a user runs it: output, and one-line errors with no traceback."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT, SHIPPED, write_model


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "ref", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_generates_on_shipped_model():
    r = run("-p", "once upon a time", "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("once upon a time") and len(r.stdout) > len("once upon a time") + 5
    assert "eval time" in r.stderr and "tokens per second" in r.stderr


def test_same_seed_same_text():
    a = run("-p", "the cat", "-n", "10", "-s", "42", "--temp", "1.0")
    b = run("-p", "the cat", "-n", "10", "-s", "42", "--temp", "1.0")
    assert a.returncode == 0 and a.stdout == b.stdout


def broken_copy(tmp_path, how):
    d = tmp_path / "model"
    shutil.copytree(SHIPPED, d)
    if how == "config":
        (d / "config.json").write_text("{oops")
    elif how == "act":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu_new"}))
    elif how == "truncated":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "tokenizer":
        (d / "tokenizer.json").write_text("not json")
    elif how == "no-tokenizer":
        (d / "tokenizer.json").unlink()
    return d


@pytest.mark.parametrize("args, expect", [
    (["/nonexistent/model"], "no such folder"),
    (["-n", "-2"], "-n/--n-predict must be >= 0, or -1"),
    (["--temp", "-1"], "--temp must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["-c", "9999"], "exceeds the model's context"),
    (["-p", "once upon a time " * 200], "longer than the context"),
])
def test_bad_flags(args, expect):
    r = run(*args)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error:") and expect in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("how, expect", [
    ("config", "config.json: not valid JSON"),
    ("act", "unsupported hidden_act 'gelu_new' (supported: relu"),
    ("truncated", "model.safetensors: truncated"),
    ("tokenizer", "tokenizer.json: not a valid tokenizer file"),
    ("no-tokenizer", "tokenizer.json: missing"),
])
def test_bad_model_folder(tmp_path, how, expect):
    r = run(broken_copy(tmp_path, how), "-n", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error:") and expect in r.stderr and r.stderr.count("\n") == 1


def test_missing_tensor_named(tmp_path):
    from tests.helpers import SMALL_CONFIG, random_tensors
    t = random_tensors(SMALL_CONFIG)
    del t["model.norm.weight"]
    d = write_model(tmp_path, tensors=t)
    shutil.copy(SHIPPED / "tokenizer.json", d)
    r = run(d, "-n", "2")
    assert r.returncode == 1 and "missing 1 tensor(s), first model.norm.weight" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("script", ["profile", "train_predictors", "eval_sparse", "bench", "bench_placement",
                                    "bench_gpu", "measure_profile_memory"])
def test_every_script_has_dash_h(script):
    from tests.helpers import load_script
    from click.testing import CliRunner
    r = CliRunner().invoke(load_script(script).main, ["-h"])
    assert r.exit_code == 0 and "Usage:" in r.output
