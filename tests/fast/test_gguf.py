"""GGUF in and out: files we write read back with llama.cpp's own `gguf` reader; fast on a converted file computes what
fast on the HF folder computes at that format; PowerInfer's files run sparse with their own predictors; bad files
are one clear line."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import ref
from fast import Engine, apply_predictors
from fast.load import load_engine
from fast.layers import Bundles, StoredDown
from ref.common.artifacts import Predictors
from ref.common.batch import Batch
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from ref.common.gguf_io import gguf_metadata, read_gguf, rope_rows
from ref.common.safetensors import upcast
from ref.common.tokenizer import load_tokenizer
from ref.quant import Transposed, pad_hidden, predictor_format, predictors_beside, quantize, values
from tests.helpers import ROOT, SHIPPED, assert_close, write_gguf

TYPES = ["f16", "q8_0", "q4_0"]
IDS = np.array([1, 57, 300, 12, 901, 4000, 7, 7, 2])


def convert(*args):
    return subprocess.run([sys.executable, "-m", "fast.convert", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The shipped model converted: PowerInfer layout in each type, and llama.cpp's (--dense) in q8_0."""
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for t in TYPES:
        r = convert(SHIPPED, "-o", d / f"m-{t}.gguf", "--type", t)
        assert r.returncode == 0 and r.stdout.startswith(f"wrote {d / f'm-{t}.gguf'}: PowerInfer GGUF, {t}"), r.stderr
        out[t] = d / f"m-{t}.gguf"
    r = convert(SHIPPED, "-o", d / "dense.gguf", "--type", "q8_0", "--dense")
    assert r.returncode == 0, r.stderr
    out["dense"] = d / "dense.gguf"
    return out


def as_gguf_magic(path, tmp_path):
    """A PWRI file with llama.cpp's magic, for gguf's reader (which knows only GGUF)."""
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    with open(copy, "r+b") as f:
        assert f.read(4) == b"PWRI"
        f.seek(0)
        f.write(b"GGUF")
    return copy


@pytest.mark.parametrize("fmt", TYPES)
def test_round_trip_through_llama_cpps_reader(files, fmt, tmp_path):
    """Every tensor equals gguf.quants of the HF weights (q/k rows in llama.cpp's order, down transposed) and the
    metadata says the model's shape."""
    r = gguf.GGUFReader(as_gguf_magic(files[fmt], tmp_path))
    m = ref.load_model(SHIPPED)
    c, w = m.config, m.weights
    t = {x.name: x for x in r.tensors}
    qtype = gguf.GGMLQuantizationType[fmt.upper()]

    def check(name, want, kind=qtype):
        got = t[name]
        assert got.tensor_type == kind, name
        ours = np.asarray(gguf.quants.quantize(np.ascontiguousarray(want, np.float32), kind)).view(np.uint8)
        assert np.array_equal(np.asarray(got.data).view(np.uint8).reshape(ours.shape), ours), name

    E = c.head_dim
    check("blk.1.attn_q.weight", w["layers.1.wq"].astype(np.float32)[rope_rows(c.n_heads, E, True)])
    check("blk.1.attn_k.weight", w["layers.1.wk"].astype(np.float32)[rope_rows(c.n_kv_heads, E, True)])
    check("blk.2.ffn_gate.weight", w["layers.2.wg"].astype(np.float32))
    check("blk.2.ffn_down_t.weight", w["layers.2.wd"].astype(np.float32).T)
    check("output.weight", w["lm_head"].astype(np.float32))
    check("blk.0.attn_norm.weight", w["layers.0.attn_norm"].astype(np.float32), gguf.GGMLQuantizationType.F32)
    pred = Predictors.load(SHIPPED / "predictors.safetensors", c)
    pfmt = predictor_format(FORMATS[fmt], c.d_model)  # q8_0 beside f16 and bf16
    check("blk.3.fc2.weight", pad_hidden(pred.fc1[3], pred.fc2[3], pfmt.block)[1], gguf.GGMLQuantizationType[pfmt.name.upper()])
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == c.n_layers
    assert (meta["llama.embedding_length"], meta["llama.feed_forward_length"]) == (c.d_model, c.d_ffn)
    assert (meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]) == (c.n_heads, c.n_kv_heads)
    assert meta["powerinfer.sparse_threshold"] == pytest.approx(pred.threshold)
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == c.vocab_size
    # PowerInfer's count (9 block tensors + fc1 + fc2 per layer), and the thresholds of 3 methods (table, greedy) with
    # greedy_targets and widths
    assert len(r.tensors) == 3 + c.n_layers * 11 + 8


def test_dense_layout_is_llama_cpps(files):
    r = gguf.GGUFReader(files["dense"])  # magic GGUF: the reader takes it as it is
    names = {t.name for t in r.tensors}
    assert "blk.0.ffn_down.weight" in names and not any("fc1" in n or "ffn_down_t" in n for n in names)


@pytest.mark.parametrize("fmt", TYPES)
def test_fast_on_the_file_is_fast_on_the_folder_at_that_format(files, fmt):
    """Dense and with the file's own predictors: the same logits as the HF folder converted at load."""
    on_file = Engine.load(files[fmt])
    on_folder = Engine.load(SHIPPED, fmt=FORMATS[fmt])
    assert on_file.format.name == fmt
    assert_close(on_file.logits(IDS), on_folder.logits(IDS), rtol=1e-6)
    pred = Predictors.load(SHIPPED / "predictors.safetensors", on_folder.config)
    sparse_file = apply_predictors(on_file, on_file.file_predictors)
    sparse_folder = apply_predictors(on_folder, predictors_beside(pred, FORMATS[fmt]))
    assert sparse_file.selector.threshold == pytest.approx(pred.threshold)
    assert_close(sparse_file.logits(IDS), sparse_folder.logits(IDS), rtol=1e-6)


def test_ref_reads_the_file_too(files):
    """ref loads a GGUF into the same Weights: the dense model at the file's values."""
    m = ref.load_model(files["q8_0"])
    want = ref.quant.quantize_model(ref.load_model(SHIPPED), "q8_0")
    assert_close(m.logits(IDS), want.logits(IDS), rtol=1e-6)


def test_the_file_carries_the_tokenizer(files, tmp_path):
    text = "once upon a time, Lily saw a BIG dog."
    assert load_tokenizer(files["q4_0"]).encode(text) == load_tokenizer(SHIPPED).encode(text)


def test_tokenizer_from_llama_cpp_metadata_alone(files, tmp_path):
    """Without tokenizer.huggingface.json: the byte-level BPE rebuilt from tokenizer.ggml.tokens and merges (the
    shipped tokenizer's lowercasing is not in llama.cpp's metadata, so lowercase text)."""
    r = gguf.GGUFReader(files["dense"])
    w = gguf.GGUFWriter(tmp_path / "tok.gguf", "llama")
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        f = r.fields[k]
        w.add_key_value(k, f.contents(), f.types[0], f.types[-1])
    w.add_bos_token_id(1)
    w.add_add_bos_token(True)  # a 'gpt2' vocabulary of the default pre-tokenizer adds none unless the file says so
    w.add_eos_token_id(2)
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    text = "once upon a time, lily saw a big dog. she said: \"hello!\""
    got, want = load_tokenizer(tmp_path / "tok.gguf"), load_tokenizer(SHIPPED)
    assert got.encode(text) == want.encode(text) and got.decode(want.encode(text)) == want.decode(want.encode(text))


def test_run_a_powerinfer_file_sparse_without_flags(files):
    r = subprocess.run([sys.executable, "-m", "fast.run", files["q4_0"], "-p", "once upon a time", "-n", "6", "--temp",
                        "0"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "weights q4_0; FFN sparse" in r.stderr and "own, threshold" in r.stderr


# ---------------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("arch, kv, message", [
    ("gpt2", {}, "architecture 'gpt2' is not supported"), ("qwen2moe", {}, "architecture 'qwen2moe' is not supported"),
    ("llama", {"expert_count": 8}, "a mixture-of-experts model (llama.expert_count 8) is not supported")])
def test_unknown_architecture(tmp_path, arch, kv, message):
    with pytest.raises(UserError, match=re.escape(message)):
        read_gguf(write_gguf(tmp_path / "a.gguf", arch=arch, **kv))


def test_unknown_tensor_type(files, tmp_path):
    """A Q5_0 matrix where this engine reads F32, F16, BF16, Q8_0 and Q4_0 only."""
    r = gguf.GGUFReader(files["dense"])
    w = gguf.GGUFWriter(tmp_path / "q5.gguf", "llama")
    for k, f in r.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if t.name == "blk.0.ffn_up.weight":
            vals = values(np.asarray(t.data).view(FORMATS["q8_0"].dtype))
            w.add_tensor(t.name, gguf.quants.quantize(vals, gguf.GGMLQuantizationType.Q5_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q5_0)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="tensor blk.0.ffn_up.weight is Q5_0; this engine reads F32, F16, BF16, Q8_0"):
        read_gguf(tmp_path / "q5.gguf")


def test_truncated_file(files, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["q8_0"].read_bytes()[: files["q8_0"].stat().st_size // 2])
    with pytest.raises(UserError, match="truncated or corrupt"):
        read_gguf(cut)


def test_predictors_that_do_not_match_the_layers(files, tmp_path):
    """A PWRI file whose last layer lacks its fc2."""
    src = gguf.GGUFReader(as_gguf_magic(files["f16"], tmp_path))
    last = max(int(t.name.split(".")[1]) for t in src.tensors if t.name.startswith("blk."))
    w = gguf.GGUFWriter(tmp_path / "p.gguf", "llama")
    for k, f in src.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in src.tensors:
        if t.name != f"blk.{last}.fc2.weight":
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(tmp_path / "p.gguf", "r+b") as f:
        f.write(b"PWRI")
    with pytest.raises(UserError, match=f"predictors do not match the .* layers: blk.{last}.fc2.weight is missing"):
        read_gguf(tmp_path / "p.gguf")


def test_type_on_a_file_quantized_to_another_format(files):
    with pytest.raises(UserError, match="--type q8_0: .* is quantized to q4_0 already"):
        load_engine(files["q4_0"], type_="q8_0")


def test_refused_before_loading_when_memory_is_short(files, monkeypatch):
    import fast.load
    monkeypatch.setattr(fast.load, "memory_available", lambda: 1 << 20)
    with pytest.raises(UserError, match=r"needs .* GiB of memory \(q4_0 weights .* GiB, KV cache .* GiB\), 0.0 GiB available"):
        load_engine(files["q4_0"])


@pytest.mark.parametrize("args, expect", [
    (["--type", "q5_k"], "--type: unknown format 'q5_k'"),
    (["--predictors", "/nonexistent.safetensors"], "--predictors /nonexistent.safetensors: not found"),
    (["--dense", "--predictors", "x"], "--dense and --predictors contradict each other"),
])
def test_convert_bad_flags(tmp_path, args, expect):
    r = convert(SHIPPED, "-o", tmp_path / "x.gguf", *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr and expect in r.stderr and r.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_convert_a_llama_cpp_file_to_a_powerinfer_file(files, tmp_path):
    """llama.cpp's q8_0 file (ffn_down quantized along F) + predictors -> our layout, as llama-quantize takes a GGUF
    in: ffn_down_t re-laid once, every other tensor copied as it is; its load is a memory map and computes what
    the engine computes when it re-lays the same file at load."""
    pred = SHIPPED / "predictors.safetensors"
    r = convert(files["dense"], "-o", tmp_path / "p.gguf", "--predictors", pred)
    assert r.returncode == 0 and "PowerInfer GGUF, q8_0" in r.stdout, r.stderr
    a, b = read_gguf(files["dense"]), read_gguf(tmp_path / "p.gguf")
    assert b.kind == "powerinfer" and isinstance(b.tensors["layers.0.wd"], Transposed)
    for name, t in a.tensors.items():
        if not name.endswith(".wd"):
            assert np.array_equal(np.asarray(t.blocks if hasattr(t, "blocks") else t).view(np.uint8),
                                  np.asarray(b.tensors[name].blocks if hasattr(t, "blocks") else b.tensors[name]
                                             ).view(np.uint8)), name
    assert gguf_metadata(tmp_path / "p.gguf").fields["tokenizer.ggml.tokens"] == a.meta.fields["tokenizer.ggml.tokens"]
    relaid = apply_predictors(Engine.load(files["dense"]), b.predictors)  # as the file stores them (q8_0)
    mapped = apply_predictors(Engine.load(tmp_path / "p.gguf"), b.predictors)
    assert_close(mapped.logits(IDS), relaid.logits(IDS), rtol=1e-6)
    r = convert(tmp_path / "p.gguf", "-o", tmp_path / "d.gguf", "--dense", "--type", "q4_0")  # and back, requantized
    assert r.returncode == 0 and "llama.cpp GGUF, q4_0" in r.stdout, r.stderr
    assert not isinstance(read_gguf(tmp_path / "d.gguf").tensors["layers.0.wd"], Transposed)


@pytest.mark.parametrize("args, expect", [
    ([], "no predictors and no activation-sparsity thresholds to carry; --predictors FILE adds predictors"),
    (["--type", "q5_k"], "--type: unknown format 'q5_k'")])
def test_convert_of_a_gguf_file_bad_flags(files, tmp_path, args, expect):
    r = convert(files["dense"], "-o", tmp_path / "x.gguf", *args)
    assert r.returncode == 1 and expect in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_convert_onto_its_own_input_is_one_line(files, tmp_path):
    shutil.copy(files["dense"], tmp_path / "m.gguf")
    r = convert(tmp_path / "m.gguf", "-o", tmp_path / "m.gguf", "--dense", "--force")
    assert r.returncode == 1 and "the file being read" in r.stderr and r.stderr.count("\n") == 1


def test_convert_refuses_to_overwrite(files):
    r = convert(SHIPPED, "-o", files["f16"], "--type", "f16")
    assert r.returncode == 1 and "exists: pass --force" in r.stderr


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    """A failure half-way (here: the fifth tensor) removes the partial file; no OUT appears."""
    from ref.common import gguf_io
    calls = []
    real = gguf_io.tensor_bytes

    def failing(t):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(t)
    monkeypatch.setattr(gguf_io, "tensor_bytes", failing)
    from fast.convert import main
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        main([str(SHIPPED), "-o", str(tmp_path / "x.gguf"), "--type", "q8_0"], standalone_mode=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig, code, last", [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")])
def test_a_signalled_conversion_leaves_nothing(tmp_path, sig, code, last):
    """SIGTERM or Ctrl-C while the file is written: its temporary file removed, no OUT, one line (SIGKILL cannot
    be caught: it leaves the .part file)."""
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "fast.convert", str(SHIPPED), "-o", str(tmp_path / "x.gguf"),
                          "--type", "q4_0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob("*.part")) and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert p.returncode == code and err.strip().splitlines()[-1] == last and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("variant", ["llama3-rope", "llama-linear-rope", "mistral-window", "qwen2", "qwen3"])
def test_convert_writes_what_llama_cpps_converter_writes(tmp_path, variant):
    """Each LLaMA-family variant written by fast.convert --dense (f32) holds the tensors llama.cpp's own
    convert_hf_to_gguf.py wrote for it (tests/families/*/llama.cpp.gguf): the same architecture, names and values
    (Q/K rows permuted for llama only, rope_freqs for Llama-3's scaling, linear scaling in the metadata), and gives
    transformers' logits."""
    from tests.helpers import FAMILIES
    from tests.ref.test_families import check_golden
    r = convert(FAMILIES / variant, "-o", tmp_path / "x.gguf", "--dense", "--type", "f32")
    assert r.returncode == 0, r.stderr
    ours, theirs = gguf.GGUFReader(tmp_path / "x.gguf"), gguf.GGUFReader(FAMILIES / variant / "llama.cpp.gguf")
    assert ours.fields["general.architecture"].contents() == theirs.fields["general.architecture"].contents()
    for key in ("rope.scaling.type", "rope.scaling.factor", "rope.freq_base"):
        key = f"{theirs.fields['general.architecture'].contents()}.{key}"
        assert (key in ours.fields) == (key in theirs.fields), key
        if key in theirs.fields:
            assert ours.fields[key].contents() == pytest.approx(theirs.fields[key].contents()), key
    want = {t.name: t for t in theirs.tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(want)
    for t in ours.tensors:
        assert_close(np.asarray(t.data), np.asarray(want[t.name].data), rtol=1e-6, name=t.name)
    check_golden(ref.load_model(tmp_path / "x.gguf"), variant)


def test_convert_to_a_folder_is_one_line(tmp_path):
    r = convert(SHIPPED, "-o", tmp_path, "--force")
    assert r.returncode == 1 and "a folder; name the file to write" in r.stderr and r.stderr.count("\n") == 1


def test_convert_writes_only_regular_files(tmp_path):
    """--force replaces a file or a link, never a FIFO or a device (a rename would put a regular file in their
    place: /dev/null as root), here or in a writer's own rename."""
    import os
    from ref.common.artifacts import replace_file
    os.mkfifo(tmp_path / "fifo")
    for target in (tmp_path / "fifo", Path("/dev/null")):
        r = convert(SHIPPED, "-o", target, "--force", "--dense")
        assert r.returncode == 1 and r.stderr == f"error: -o {target}: not a regular file (a device, a FIFO or a socket); name a file to write\n"
        assert not target.is_file()
    (tmp_path / "part").write_bytes(b"x")
    with pytest.raises(UserError, match="fifo: not a regular file"):
        replace_file(tmp_path / "part", tmp_path / "fifo")
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["fifo", "part"]


def test_sentencepiece_tokenizer_from_llama_cpp_metadata(tmp_path):
    """tokenizer.ggml.model 'llama': pieces merge by score (higher first), '▁' marks a space, <0xNN> bytes cover
    what the vocabulary lacks."""
    pieces = ["<unk>", "<s>", "</s>", "<0x21>", "\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "abc", "\u2581abc"]
    scores = [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    types = [2, 3, 3, 6] + [1] * (len(pieces) - 4)  # UNKNOWN, CONTROL, BYTE, NORMAL
    path = write_gguf(tmp_path / "spm.gguf", tokenizer_model="llama", token_list=pieces, token_scores=scores,
                      token_types=types, bos_token_id=1, eos_token_id=2, unk_token_id=0)
    tok = load_tokenizer(path)
    ids = tok.encode("abc ab!")
    assert [pieces[i] for i in ids] == ["<s>", "\u2581abc", "\u2581ab", "<0x21>"]
    assert tok.decode(ids) == "abc ab!"


def test_llama_cpp_computes_what_we_compute_on_our_file(tmp_path):
    """Where llama-cpp-python is installed (the 'peer' extra): llama.cpp loads files we wrote (llama.cpp's layout, a
    SwiGLU model since that is what its llama graph computes, its KV cache in f32 as ours) and its logits are ours
    on the same file (fast on the float formats, ref on the block formats, whose ffn_down fast refuses): tensors,
    row order for RoPE, metadata and Q8_0-rounded dot products all agree (measured: 1e-7 for f32, q8_0, q4_0)."""
    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama
    from tests.helpers import write_model
    d = write_model(tmp_path / "m", {"hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
                                     "max_position_embeddings": 64}, seed=2)
    shutil.copy(SHIPPED / "tokenizer.json", d / "tokenizer.json")
    ids = [1, 57, 300, 12, 901, 4000, 7]
    for fmt, ours in (("f32", Engine.load), ("f16", Engine.load), ("q8_0", ref.load_model), ("q4_0", ref.load_model)):
        r = convert(d, "-o", tmp_path / f"{fmt}.gguf", "--type", fmt, "--dense")
        assert r.returncode == 0, r.stderr
        llm = Llama(model_path=str(tmp_path / f"{fmt}.gguf"), n_ctx=64, n_threads=1, logits_all=True, verbose=False,
                    type_k=0, type_v=0)  # GGML_TYPE_F32
        for i in ids:  # one token at a time: llama.cpp's AMX kernels (batches of quantized weights) crash in this VM
            llm.eval([i])
        theirs = np.array(llm.scores[: len(ids)], np.float32)
        # f16: some llama.cpp builds round the activations to f16 for F16 weights (4.5e-4 here), others do not (3e-7)
        assert_close(ours(tmp_path / f"{fmt}.gguf").logits(np.array(ids)), theirs, rtol=1e-3 if fmt == "f16" else 1e-5,
                     name=fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_quantized_llama_cpp_file_runs_as_stored(tmp_path, fmt):
    """llama.cpp's quantized ffn_down (blocks along F, as every Q8_0/Q4_0 GGUF on the Hub has it) runs dense as
    stored: ref's logits on the same file, a prompt and one token at a time. With predictors it is re-laid once as
    ffn_down_t (bundled): its values quantized again along D (the shipped model's perplexity in q4_0: +0.07 %).
    (A random model: the shipped one's first layer reads the Q8_0 lattice of its embeddings, whose rounding ties
    part ref and fast at 2e-3 in every layout.)"""
    from fast.bench import synthetic_predictors
    from tests.helpers import write_model
    d = write_model(tmp_path / "m", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "vocab_size": 4096}, seed=3)
    shutil.copy(SHIPPED / "tokenizer.json", d / "tokenizer.json")
    r = convert(d, "-o", tmp_path / "m.gguf", "--type", fmt, "--dense")
    assert r.returncode == 0, r.stderr
    e, m = Engine.load(tmp_path / "m.gguf"), ref.load_model(tmp_path / "m.gguf")
    assert isinstance(e.layers[0].ffn, StoredDown)
    ids = IDS[:8]
    want = m.logits(ids)
    assert_close(e.logits(ids), want, rtol=1e-4)
    cache = e.new_cache(len(ids))
    steps = np.concatenate([e.forward(Batch.single(ids[t:t + 1], cache), cache) for t in range(len(ids))])
    assert_close(steps, want, rtol=1e-4)
    pred = synthetic_predictors(e.config, 8, seed=1)
    sparse = apply_predictors(e, pred)
    assert isinstance(sparse.layers[0].ffn, Bundles) and sparse.layers[0].ffn.bundle.shape[1] == 3
    for l in range(m.config.n_layers):  # ref's model of the re-lay: each down matrix's values quantized along D
        wd = m.weights.tensors[f"layers.{l}.wd"]
        m.weights.tensors[f"layers.{l}.wd"] = Transposed(quantize(upcast(wd).T, fmt))
    assert_close(sparse.logits(ids), ref.apply_predictors(m, pred).logits(ids), rtol=1e-4)


def test_a_llama_cpp_float_file_runs_dense_without_flags(tmp_path):
    """A GGUF without predictors (llama.cpp's layout) runs dense by default."""
    r = convert(SHIPPED, "-o", tmp_path / "f16.gguf", "--type", "f16", "--dense")
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "fast.run", tmp_path / "f16.gguf", "-p", "once upon a time", "-n", "4",
                        "--temp", "0"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "weights f16; FFN dense" in r.stderr, r.stderr


def test_a_powerinfer_file_carries_the_activation_sparsity_calibration(files, tmp_path):
    """The folder's sparsity.safetensors rides in our file (`sparsity.` tensors), which then runs --sparsity as the
    folder does; a SwiGLU model without predictors converts with its thresholds alone; llama.cpp's layout (--dense)
    carries none, and --sparsity then asks for --sparsity-file."""
    from ref.activation_sparsity import Thresholds
    from tests.helpers import SHIPPED_SILU
    own = Thresholds.load(SHIPPED / "sparsity.safetensors")
    carried = read_gguf(files["q8_0"]).sparsity
    for m in own.tables:
        assert np.array_equal(carried.tables[m], own.tables[m]) and np.array_equal(carried.greedy[m], own.greedy[m])
    assert np.array_equal(carried.widths, own.widths) and read_gguf(files["dense"]).sparsity is None
    from_file = load_engine(files["q8_0"], sparsity=0.5, sparsity_method="wina").logits(IDS)
    from_folder = load_engine(SHIPPED, type_="q8_0", sparsity=0.5, sparsity_method="wina").logits(IDS)
    assert_close(from_file, from_folder, rtol=1e-6)
    r = convert(SHIPPED_SILU, "-o", tmp_path / "silu.gguf")
    assert r.returncode == 0 and "PowerInfer GGUF, f16" in r.stdout, r.stderr
    assert read_gguf(tmp_path / "silu.gguf").predictors is None
    assert_close(load_engine(tmp_path / "silu.gguf", sparsity=0.4).logits(IDS),
                 load_engine(SHIPPED_SILU, sparsity=0.4).logits(IDS), rtol=1e-6)
    with pytest.raises(UserError, match="carries no thresholds; name a file with --sparsity-file"):
        load_engine(files["dense"], sparsity=0.4)
    load_engine(files["dense"], sparsity=0.4, sparsity_file=SHIPPED / "sparsity.safetensors")
