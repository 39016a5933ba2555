import os

import numpy as np
import pytest

import ref
from ref.common.artifacts import atomic_save
from ref.common.errors import UserError
from ref.model import fired
from ref.common.artifacts import load_activations, save_activations
from ref.common.batch import Batch
from ref.profile import Reservoir, collect_samples, corpus_windows, firing_stats, profile_activations
from tests.helpers import SHIPPED, SMALL_CONFIG, write_model

TEXT = "once upon a time there was a cat.\nthe cat liked to play with a red ball.\n" * 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    write_model(d)
    corpus = d / "corpus.txt"
    corpus.write_text(TEXT)
    return d, corpus, ref.load_tokenizer(SHIPPED)


def small_windows(tok, corpus, n=None):
    # The shipped tokenizer has vocab 4096; the random model has 50 tokens: fold ids into its vocab.
    for ids, frac in corpus_windows(tok, corpus, 24, n):
        yield ids % SMALL_CONFIG["vocab_size"], frac


def brute_force_counts(model, windows):
    """Fire masks from a plain forward pass that records gate/up of every layer."""
    c = model.config
    counts = np.zeros((c.n_layers, c.d_ffn), np.int64)
    dense = model.dense_ffn_block

    def spy(l, h):
        g, u = model.ffn_gate_up(l, h)
        counts[l] += fired(c.ffn_kind, g, u).sum(0)
        return dense(l, h)

    model.ffn_block = spy
    tokens = 0
    for ids, _ in windows:
        cache = model.new_cache(len(ids))
        model.forward(Batch.single(ids, cache), cache)
        tokens += len(ids)
    model.ffn_block = dense
    return counts, tokens


def test_counts_equal_brute_force(setup):
    d, corpus, tok = setup
    m = ref.load_model(d)
    counts, tokens = profile_activations(m, small_windows(tok, corpus))
    want, want_tokens = brute_force_counts(ref.load_model(d), small_windows(tok, corpus))
    np.testing.assert_array_equal(counts, want)
    assert tokens == want_tokens and counts.max() <= tokens and counts.sum() > 0


def test_corpus_windows_stream_whole_text(setup):
    _, corpus, tok = setup
    windows = list(corpus_windows(tok, corpus, 32))
    assert all(len(w) == 32 for w, _ in windows[:-1]) and 0 < len(windows[-1][0]) <= 32 and windows[-1][1] == 1.0
    stream = [int(i) for w, _ in windows for i in w]
    assert stream[0] == tok.bos_id and stream[-1] == tok.eos_ids[0] and stream.count(tok.bos_id) == 1
    assert tok.decode(stream) == TEXT.strip()
    assert sum(len(w) for w, _ in corpus_windows(tok, corpus, 32, max_tokens=100)) == 100


def test_a_capped_runs_progress_is_its_share_of_the_cap(setup, monkeypatch):
    """With --max-tokens under the file's tokens, the fraction done (a progress line's ETA) is the tokens sent over
    the cap, not the share of the file read (which made a 60 s run show an hour)."""
    import ref.profile
    _, corpus, tok = setup
    monkeypatch.setattr(ref.profile, "CHUNK_BYTES", 40)  # the file read a line at a time, as a large corpus is
    done = [f for _, f in corpus_windows(tok, corpus, 32, max_tokens=100)]
    assert done == [0.32, 0.64, 0.96, 1.0]


@pytest.mark.parametrize("chunk", [1 << 20, 40])  # one read, and documents cut across many reads
def test_documents_are_bos_text_eos(tmp_path, shipped_tokenizer, monkeypatch, chunk):
    """The corpus' separator is a boundary, never text: each story is BOS, its tokens, EOS, as the model was trained."""
    from ref import profile
    monkeypatch.setattr(profile, "CHUNK_BYTES", chunk)
    long = "the dog ran to the park.\nhe was happy.\n" * 8  # longer than 4 reads of 40: sent in pieces
    stories = ["once upon a time there was a cat.", long.strip(), "the end."]
    (tmp_path / "c.txt").write_text("\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n")
    stream = [int(i) for ids, _ in profile.corpus_tokens(shipped_tokenizer, tmp_path / "c.txt") for i in ids]
    want = [i for s in stories for i in shipped_tokenizer.encode(s) + [shipped_tokenizer.eos_ids[0]]]
    bos, eos = shipped_tokenizer.bos_id, shipped_tokenizer.eos_ids[0]
    assert [i for i in stream if i in (bos, eos)] == [bos, eos] * 3
    pieces = [shipped_tokenizer.decode(p) for p in np.split(stream, np.flatnonzero(np.isin(stream, [bos, eos])))]
    assert [p for p in pieces if p] == stories and "endoftext" not in shipped_tokenizer.decode(stream)
    if chunk > 1000:  # in one read, token for token what the training script fed
        assert stream == want


def test_reservoir_is_uniform_and_deterministic():
    def run(seed):
        r = Reservoir(1, 1, 8, capacity=50, seed=seed)
        for start in range(0, 1000, 100):
            r.next_window(100)
            r.add(0, np.arange(start, start + 100, dtype=np.float32)[:, None], np.zeros((100, 8), bool))
        return r.layer(0)[0][:, 0]
    a = run(1)
    np.testing.assert_array_equal(a, run(1))
    assert len(np.unique(a)) == 50 and a.max() > 500  # late tokens get in too
    means = [run(s).mean() for s in range(30)]
    assert abs(np.mean(means) - 499.5) < 40


def test_collect_samples_pairs_inputs_with_masks(setup):
    d, corpus, tok = setup
    m = ref.load_model(d)
    res = collect_samples(m, small_windows(tok, corpus, 200), capacity=64, seed=0)
    h, mask = res.layer(1)
    assert h.shape == (64, 32) and mask.shape == (64, 100)
    g, u = m.ffn_gate_up(1, h)  # the mask is what this input fires
    np.testing.assert_array_equal(mask, fired("relu", g, u))


def test_activations_round_trip_and_numeric_layers(tmp_path):
    """12 layers: layer 10 must come back as layer 10, not after layer 1 (string sorting)."""
    counts = np.arange(12 * 5, dtype=np.int64).reshape(12, 5)
    corpus = tmp_path / "c.txt"
    corpus.write_text("x")
    d = write_model(tmp_path / "m")
    save_activations(tmp_path / "a.safetensors", counts, 100, corpus, d)
    got, tokens, meta = load_activations(tmp_path / "a.safetensors", n_layers=12, d_ffn=5)
    np.testing.assert_array_equal(got, counts)
    assert tokens == 100 and "corpus_sha256" in meta and "model_sha256" in meta


@pytest.mark.parametrize("case, message", [
    ("layers", "activations for 2 layers, the model has 3"),
    ("F", r"counts of shape \(4,\), expected \(5,\)"),
    ("gap", "layer keys are not 0..1"),
    ("key", "unexpected tensor key 'layers.one.counts'"),
    ("dup", "duplicated layer key 'layers.01.counts'"),
    ("tokens", "no 'tokens' tensor"),
])
def test_bad_activation_files(tmp_path, case, message):
    t = {"layers.0.counts": np.zeros(5, np.int64), "layers.1.counts": np.zeros(5, np.int64), "tokens": np.array([3])}
    if case == "F":
        t["layers.1.counts"] = np.zeros(4, np.int64)
    elif case == "gap":
        t["layers.2.counts"] = t.pop("layers.1.counts")
    elif case == "key":
        t["layers.one.counts"] = t.pop("layers.1.counts")
    elif case == "dup":
        t["layers.01.counts"] = t["layers.1.counts"]
    elif case == "tokens":
        del t["tokens"]
    atomic_save(tmp_path / "a.safetensors", t, {})
    with pytest.raises(UserError, match="a.safetensors: " + message):
        load_activations(tmp_path / "a.safetensors", n_layers=3 if case == "layers" else None, d_ffn=5)


def test_truncated_activation_file(tmp_path):
    atomic_save(tmp_path / "a.safetensors", {"layers.0.counts": np.zeros(5, np.int64), "tokens": np.array([3])}, {})
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(data[:-3])
    with pytest.raises(UserError, match="a.safetensors: truncated"):
        load_activations(tmp_path / "a.safetensors")


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "a.safetensors"

    def boom(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        atomic_save(target, {"x": np.zeros(3)}, {})
    assert list(tmp_path.iterdir()) == []


def test_firing_stats():
    counts = np.array([[100, 0, 0, 0, 0, 0, 0, 0, 0, 0] + [0] * 90, [1] * 100])
    s = firing_stats(counts, 100)
    assert s[0]["neurons_for_80pct"] == 0.01 and s[0]["top1pct_share"] == 1.0
    assert s[1]["neurons_for_80pct"] == 0.8 and abs(s[1]["fired_fraction"] - 0.01) < 1e-12


def test_progress_into_a_file_is_plain_lines():
    import io

    from ref.common.progress import Progress
    out = io.StringIO()
    p = Progress("profile", 4.0, stream=out, every=0)
    p.update(1)
    p.update(1)
    p.close()
    lines = out.getvalue().split("\n")
    assert "\r" not in out.getvalue() and lines[-1] == "" and lines[-2].startswith("profile: 2 tokens")
    assert "100%" in lines[-2] and "tokens/s" in lines[0]


def test_saved_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_save(tmp_path / "a.safetensors", {"x": np.zeros(3)}, {})
    finally:
        os.umask(old)
    assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == 0o644
