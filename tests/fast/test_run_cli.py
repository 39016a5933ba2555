"""`python -m fast.run` as a user runs it."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers import HAS_GPU, ROOT, SHIPPED


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "fast.run", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


def test_generates_and_reports(tmp_path):
    r = run("-p", "once upon a time", "-n", "8", "--temp", "0", "--json", tmp_path / "t.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("once upon a time") and "eval time" in r.stderr and "tokens per second" in r.stderr
    summary = json.loads((tmp_path / "t.json").read_text())
    assert summary["generated"] == 8 and summary["eval_tok_s"] > 0


def test_type_runs_the_weights_in_that_format(tmp_path):
    r = run("-p", "the cat", "-n", "6", "--temp", "0", "--type", "bf16", "--json", tmp_path / "t.json")
    assert r.returncode == 0, r.stderr
    assert "weights bf16" in r.stderr and json.loads((tmp_path / "t.json").read_text())["type"] == "bf16"


def test_prompt_batches_give_the_same_text():
    """-b 3: the prompt in forward passes of 3 tokens, the same greedy text as in one pass."""
    prompt = "once upon a time, there was a little girl named lily who"
    a, b = (run("-p", prompt, "-n", "12", "--temp", "0", *extra) for extra in ([], ["-b", "3"]))
    assert a.returncode == 0 and b.returncode == 0 and a.stdout == b.stdout


@pytest.mark.parametrize("mode", [[], ["--dense"]], ids=["default", "dense"])
def test_same_text_as_ref_greedy(mode):
    """The same command means the same model in both CLIs: sparse with the shipped predictors by default (in q8_0
    beside the f16 weights, in both), dense with --dense."""
    a = run("-p", "the cat", "-n", "24", "--temp", "0", *mode)
    b = subprocess.run([sys.executable, "-m", "ref", "-p", "the cat", "-n", "24", "--temp", "0", *mode],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and ("FFN dense" if mode else "FFN sparse") in b.stderr


@pytest.mark.parametrize("args, expect", [
    (["/nonexistent/model"], "no such folder"),
    (["-n", "-2"], "-n/--n-predict must be >= 0, or -1"),
    (["--temp", "-1"], "--temp must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["-t", "0"], "-t/--threads must be in"),
    (["-p", "once upon a time " * 200], "longer than the context"),
    (["--predictors", "/nonexistent.safetensors"], "predictors file not found"),
    (["--dense", "--predictor-type", "q8_0"], "--dense runs no predictors: --predictor-type has nothing to act on"),
    (["/etc/hostname"], "not a folder or a GGUF file"),
    (["-b", "0"], "-b/--batch-size must be >= 1, got 0"),
])
def test_bad_flags(args, expect):
    r = run(*args)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error:") and expect in r.stderr and r.stderr.count("\n") == 1


def test_corrupt_predictors(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(SHIPPED, d)
    (d / "predictors.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    r = run(d, "-n", "2")
    assert r.returncode == 1 and "predictors.safetensors: corrupt safetensors header" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(HAS_GPU, reason="a CUDA GPU is present")
@pytest.mark.parametrize("device", ["gpu", "hybrid"])
def test_gpu_device_without_gpu(device):
    import os
    r = run("--device", device, "-n", "2", env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"})
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert f"--device {device}: no CUDA GPU found" in r.stderr


@pytest.mark.parametrize("args, expect", [
    (["--vram-budget", "1"], "--vram-budget places weights on a GPU: it needs --device gpu or hybrid"),
    (["--policy", "layers"], "--policy places weights on a GPU"),
    (["--json", "/nonexistent/dir/t.json"], "--json /nonexistent/dir/t.json: folder /nonexistent/dir does not exist"),
    (["--predictor-threshold", "nan"], "--predictor-threshold must be a finite number, got nan"),
    (["-s", "-5"], "-s/--seed must be >= 0, or -1 (random), got -5"),
    (["-f", "/nonexistent.txt"], "-f/--file /nonexistent.txt: no such file"),
    (["-p", "x", "-f", __file__], "-p/--prompt and -f/--file both give a prompt"),
    (["--repeat-last-n", "-3"], "--repeat-last-n must be >= 0, or -1"),
    ([str(SHIPPED), "-m", "/tmp"], "name two models"),
])
def test_bad_flags_refused_before_loading(args, expect):
    r = run(*args, "-n", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr and expect in r.stderr and r.stderr.count("\n") == 1


def test_llamacpp_habits(tmp_path):
    """-m and -f as llama.cpp has them, ` [end of text]` at EOS, stdout ending with a newline, `python -m fast`."""
    (tmp_path / "prompt.txt").write_text("the end")
    a = run("-m", SHIPPED, "-f", tmp_path / "prompt.txt", "-n", "-1", "--temp", "0")
    assert a.returncode == 0 and a.stdout == "the end [end of text]\n"  # the shipped model ends a story there
    b = run("-p", "the end", "-n", "5", "--temp", "0", "--ignore-eos")
    assert b.returncode == 0 and b.stdout.startswith("the end") and len(b.stdout) > len("the end\n")
    c = subprocess.run([sys.executable, "-m", "fast", "-p", "once upon a time", "-n", "4", "--temp", "0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert c.returncode == 0 and c.stdout.startswith("once upon a time") and c.stdout.endswith("\n")
    assert "2 threads" in c.stderr or "1 thread;" in c.stderr


def test_llama_quantize_spelling_and_a_reader_that_stops(tmp_path):
    """--type Q4_0 as llama-quantize spells it; `| head` closing the pipe early ends the run quietly, exit 0."""
    r = run("-p", "the cat", "-n", "4", "--temp", "0", "--type", "Q8_0")
    assert r.returncode == 0 and "weights q8_0" in r.stderr, r.stderr
    p = subprocess.Popen([sys.executable, "-m", "fast.run", "-n", "-1", "--ignore-eos", "--temp", "0"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(20)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0 and "Traceback" not in err and "error" not in err


def test_context_full_is_said(tmp_path):
    r = run("-p", "once upon a time", "-n", "-1", "--temp", "0", "-c", "20", "--json", tmp_path / "t.json")
    assert r.returncode == 0 and "context full (20 tokens)" in r.stderr
    assert json.loads((tmp_path / "t.json").read_text())["stop"] == "context"


def test_context_shift_goes_on(tmp_path):
    """--context-shift: 40 tokens from a 20-token context, the prompt's first 2 kept at each shift; a --keep that
    leaves nothing to drop is one line."""
    r = run("-p", "once upon a time", "-n", "40", "--temp", "0", "-c", "20", "--context-shift", "--keep", "2",
            "--ignore-eos", "--json", tmp_path / "t.json")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "t.json").read_text())
    assert summary["generated"] == 40 and summary["stop"] == "length"
    r = run("-p", "once upon a time", "-c", "6", "--context-shift", "--keep", "-1")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: --keep")


# Not earlier: a Ctrl-C before the interpreter has started (its first ~0.1 s, more on a loaded machine) is the
# interpreter's own business, not ours.
@pytest.mark.parametrize("after", [0.4, 0.8])
def test_ctrl_c_while_starting_is_an_exit_not_a_traceback(after):
    """Ctrl-C during the imports or the load: one line, no traceback (130; 1 with click's 'Aborted!' if it lands
    while click parses the flags)."""
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "fast.run", "-n", "-1", "--ignore-eos"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert "Traceback" not in err and p.returncode in (0, 1, 130)
    assert p.returncode == 0 or err.strip().splitlines()[-1] in ("interrupted", "Aborted!")
