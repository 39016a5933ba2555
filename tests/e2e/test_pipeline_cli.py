"""The offline pipeline's scripts as a user runs them: outputs only where -o says, never over a file without --force,
the shipped corpus as the default."""

from click.testing import CliRunner

from tests.helpers import SHIPPED, load_script


def test_profile_writes_where_told_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "a.safetensors"
    main = load_script("profile").main
    r = CliRunner().invoke(main, [str(SHIPPED), "-o", str(out), "--max-tokens", "300", "--window", "64"])
    assert r.exit_code == 0, r.output
    assert out.is_file() and "300 tokens profiled" in r.output  # --max-tokens counts the stream: BOS and EOS too
    again = CliRunner().invoke(main, [str(SHIPPED), "-o", str(out), "--max-tokens", "300"])
    assert again.exit_code == 1 and "exists: pass --force to replace it" in again.output


def test_train_predictors_needs_an_output_and_tokens(tmp_path):
    main = load_script("train_predictors").main
    r = CliRunner().invoke(main, [str(SHIPPED)])
    assert r.exit_code == 2 and "Missing option '-o'" in r.output
    r = CliRunner().invoke(main, [str(SHIPPED), "-o", str(tmp_path / "p.safetensors"), "--max-tokens", "0"])
    assert r.exit_code == 2 and "--max-tokens must be >= 1" in r.output
    r = CliRunner().invoke(main, [str(SHIPPED), "-o", str(tmp_path / "no" / "p.safetensors")])
    assert r.exit_code == 1 and "folder" in r.output and "does not exist" in r.output


def test_train_predictors_reports_what_it_sampled(tmp_path):
    out = tmp_path / "p.safetensors"
    r = CliRunner().invoke(load_script("train_predictors").main, [
        str(SHIPPED), "-o", str(out), "--max-tokens", "400", "--window", "64", "--epochs", "1", "--max-hidden", "16",
        "--target-recall", "0.999"])
    assert r.exit_code == 0, r.output
    assert "sampled 400 of the corpus' 400 tokens per layer" in r.output
    assert "below --target-recall" in r.output and out.is_file()


def test_pipeline_on_every_family(tmp_path):
    """Profile, predictors and evaluation on the tiny OPT (post-norm) and Falcon (parallel) checkpoints, and on Qwen2
    (q/k/v biases) and Qwen3 (q/k norms) ReLU-fied: the window defaults to their 64-token context; the predictors
    read each family's FFN block input."""
    import json
    import shutil

    from tests.helpers import FAMILIES, variant_copy
    relufied = []
    for variant in ("qwen2", "qwen3"):
        relufied.append(variant_copy(tmp_path / f"{variant}-relu", variant, {"hidden_act": "relu"}))
        shutil.copy(FAMILIES / variant / "tokenizer.json", relufied[-1] / "tokenizer.json")
    for m in (FAMILIES / "opt-post-ln", FAMILIES / "falcon-gqa", *relufied):
        out = tmp_path / "out" / m.name
        out.mkdir(parents=True)
        r = CliRunner().invoke(load_script("profile").main, [str(m), "-o", str(out / "a.safetensors"),
                                                              "--max-tokens", "300"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(load_script("train_predictors").main, [
            str(m), "-o", str(out / "p.safetensors"), "--max-tokens", "300", "--epochs", "2", "--max-hidden", "32"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(load_script("eval_sparse").main, [
            str(m), "--predictors", str(out / "p.safetensors"), "--max-tokens", "200", "--json", str(out / "e.json")])
        assert r.exit_code == 0, r.output
        e = json.loads((out / "e.json").read_text())
        assert min(layer["recall"] for layer in e["layers"]) > 0.8, e["layers"]
        r = CliRunner().invoke(load_script("eval_sparse").main, [str(m), "--window", "65"])
        assert r.exit_code == 1 and "--window must be in [2, 64] (the model's context), got 65" in r.output
