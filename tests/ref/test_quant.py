"""Weight formats: our quantizers against llama.cpp's own Python package (gguf.quants), byte for byte, and the
quantized model as a transform."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML
from gguf import quants

import ref
from ref.common.errors import UserError
from ref.common.formats import FORMATS
from ref.common.safetensors import upcast
from ref.quant import Quantized, Transposed, input_values, quantize, quantize_model
from tests.helpers import SHIPPED, assert_close

TYPES = {"q8_0": GGML.Q8_0, "q4_0": GGML.Q4_0}


def blocks_with_edge_cases(rng, rows: int, n: int) -> np.ndarray:
    """Random rows, plus an all-zero block, a block whose largest |x| is negative, ties for the largest |x|, values
    that land on rounding halves, and huge and tiny scales."""
    x = (rng.standard_normal((rows, n)) * rng.choice([1e-3, 1.0, 30.0], size=(rows, 1))).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = np.linspace(-1, 0.5, 32)
    x[2, :32] = np.tile([2.0, -2.0, 1.0, 0.25], 8)
    x[3, :32] = np.arange(32) * 0.5 - 8
    return x


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("rows, n", [(5, 32), (7, 256), (4, 96)])
def test_quantizer_bytes_equal_gguf(fmt, rows, n):
    x = blocks_with_edge_cases(np.random.default_rng(rows * n), rows, n)
    ours = quantize(x, fmt)
    want = quants.quantize(x, TYPES[fmt])
    assert isinstance(ours, Quantized) and ours.blocks.shape == want.shape == (rows, n // 32 * FORMATS[fmt].block_bytes)
    np.testing.assert_array_equal(ours.blocks, want)
    np.testing.assert_array_equal(upcast(ours), quants.dequantize(want, TYPES[fmt]))


@pytest.mark.parametrize("fmt, rtol", [("f32", 0), ("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 1e-2), ("q4_0", 0.2)])
def test_stored_values_approximate_the_input(fmt, rtol):
    x = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    q = quantize(x, fmt)
    assert_close(upcast(q), x, rtol=rtol)
    assert_close(upcast(q[2:4]), upcast(q)[2:4], rtol=0)  # rows of the stored tensor are rows of its values


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_product_reads_its_input_in_its_formats_input_format(fmt):
    """Format.vec_dot (llama.cpp's vec_dot_type): q8_0 and q4_0 weights read their input rounded to Q8_0 blocks, float
    weights and a stored transpose read it as it is."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 64)).astype(np.float32), quantize(rng.standard_normal((4, 64)), fmt)
    want = x if FORMATS[fmt].vec_dot is None else upcast(quantize(x, FORMATS[fmt].vec_dot), np.float32)
    assert (FORMATS[fmt].vec_dot is None) == (not FORMATS[fmt].quantized)
    np.testing.assert_array_equal(input_values(x, w), want)
    np.testing.assert_array_equal(input_values(x, Transposed(w)), x)


def test_f16_and_bf16_round_to_nearest_even():
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    np.testing.assert_array_equal(upcast(quantize(x[:2], "f16")), [1, 1 + 2**-9])
    np.testing.assert_array_equal(upcast(quantize(x[2:], "bf16")), [1, 1 + 2**-6])


def test_transposed_reads_columns():
    x = np.random.default_rng(2).standard_normal((64, 5)).astype(np.float32)  # [D, F]
    t = Transposed(quantize(x.T, "q8_0"))
    assert t.shape == (64, 5)
    np.testing.assert_array_equal(upcast(t[:, [1, 3]]), upcast(t)[:, [1, 3]])


def test_rows_must_be_whole_blocks():
    with pytest.raises(UserError, match="--type q4_0: w has rows of 33 elements, not whole blocks of 32"):
        quantize(np.zeros((2, 33), np.float32), "q4_0", "w")


@pytest.mark.parametrize("fmt, rtol", [("f16", 1e-3), ("bf16", 3e-2), ("q8_0", 3e-2), ("q4_0", 0.3)])
def test_quantized_model_is_the_model_at_its_stored_values(fmt, rtol):
    """The transform changes what the weights mean, not the model code: logits move by the format's error only,
    and the down matrix is stored as ffn_down_t."""
    ids = ref.load_tokenizer(SHIPPED).encode("once upon a time, there was a little dog")
    want = ref.load_model(SHIPPED).logits(ids)
    m = quantize_model(ref.load_model(SHIPPED), fmt)
    assert isinstance(m.weights["layers.0.wd"], Transposed) and m.format.name == fmt
    assert_close(m.logits(ids), want, rtol=rtol)


def test_quantized_model_runs_sparse():
    """Transforms compose: predictors on a quantized model read the stored rows of the active neurons only."""
    ids = ref.load_tokenizer(SHIPPED).encode("the cat sat on the mat")
    pred = SHIPPED / "predictors.safetensors"
    want = quantize_model(ref.load_model(SHIPPED), "q8_0").logits(ids)
    sparse = ref.apply_predictors(quantize_model(ref.load_model(SHIPPED), "q8_0"), pred)
    dense_pred = ref.load_model(SHIPPED, predictors=pred).logits(ids)
    assert_close(sparse.logits(ids), dense_pred, rtol=3e-2)
    assert not np.allclose(sparse.logits(ids), want, rtol=1e-3)  # sparse, not dense


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "q4_0"])
def test_predictors_of_any_width_take_one_format(fmt):
    """A predictor of any hidden size (the trainer's ladder starts at 16) is padded to whole blocks by zero hidden
    units: every layer stored alike, and the same function (relu(0) adds 0: up to the float sums' order) before
    rounding."""
    from ref.common.artifacts import Predictors
    from ref.quant import pad_hidden, quantize_predictors, tensor_format
    from ref.sparse import predictor_logits
    rng = np.random.default_rng(3)
    D, F = 64, 96
    fc1 = [rng.standard_normal((R, D)).astype(np.float32) for R in (16, 33, 64)]
    fc2 = [rng.standard_normal((F, a.shape[0])).astype(np.float32) for a in fc1]
    h = rng.standard_normal((5, D)).astype(np.float32)
    for a, b in zip(fc1, fc2):
        pa, pb = pad_hidden(a, b, 32)
        assert pa.shape[0] % 32 == 0 and pb.shape == (F, pa.shape[0])
        assert_close(predictor_logits(h, pa, pb), predictor_logits(h, a, b), rtol=1e-6)
    q = quantize_predictors(Predictors(fc1, fc2, 0.0, {}), fmt)
    assert {tensor_format(t).name for t in (*q.fc1, *q.fc2)} == {fmt}
    assert [t.shape[0] for t in q.fc1] == ([16, 33, 64] if fmt == "f16" else [32, 64, 64])


def test_predictors_of_a_model_whose_rows_are_not_blocks_are_refused():
    from ref.common.artifacts import Predictors
    from ref.quant import quantize_predictors
    p = Predictors([np.zeros((16, 48), np.float32)], [np.zeros((64, 16), np.float32)], 0.0, {})
    with pytest.raises(UserError, match="--predictor-type q8_0: layer 0's fc1 has rows of 48 elements"):
        quantize_predictors(p, "q8_0")
