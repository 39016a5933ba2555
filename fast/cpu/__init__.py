"""CPU kernels (numba); outputs first in every signature. Each computes a ref function, under its name where ref has
one, or composes several (docs/design.md, "What mirrors what").

Parallel loops are race-free by construction: each `prange` iteration writes only its own rows or its own
private accumulator, and any reduction over workers is a separate loop (stumpy's rule). Work is cut into a
fixed number of chunks, not per thread, so results are bit-identical from run to run.

STREAMS: the weight kernels split each chunk's rows (or neurons) into four equal quarters and step through them
together, so a worker reads four long forward streams, as the read probe does, instead of a few adjacent rows.
With two cores the kernels are bound by the reads one core keeps in flight, not by the bus, whenever the bus is
fast; there four streams read up to 10 % faster than adjacent rows.

FORMATS: the weight kernels read rows in every format of ref.common.formats (its `dtype`: float32, f16 and bf16 bits
as uint16 records, q8_0 and q4_0 blocks) through the row operations of `fast.quant` (dot4, dot, axpy4, axpy, and
quantize_input for the token), which numba resolves per format when it compiles the kernel; everything else is
float32.

The package by concern: `base` (norms, embeddings, biases, RoPE, activations, hints), `matmul`, `attention`, `ffn`
(the sparse and dense FFN, the predictor), `thin` (activation sparsity's thinning and
the input-sparse product), `step` (a decode step of every layer in one call). Kernels compile on first
use; numba caches them beside their files, stamped by every kernel source (fast.kernel_cache).

Dimensions: T tokens, S cached positions, D d_model, F FFN neurons, H/K query/key-value heads, E head dim,
N output rows, R predictor hidden size, C accumulator chunks.
"""

from fast import kernel_cache

kernel_cache.install()  # before any kernel is defined: numba picks a function's cache locator then

from fast.cpu.attention import (BLOCK, SPLIT, attend, attention, attention_block, causal_logits,  # noqa: E402
                                decode_attention, decode_attention_block, exp_le0, merge_items, normalize_rows,
                                qk_norm, qkv_proj, self_attention, store_kv)
from fast.cpu.base import (BLOCKS, CATS, FASTMATH, KINDS, activation, activation_py, add_bias,  # noqa: E402
                           chunk_bounds, copy_rows, embed, layernorm, norm, prefetch, prefetch_row, prefetch_rows,
                           read_bandwidth_probe, rmsnorm, rope, sum_chunks)
from fast.cpu.ffn import (TILE_SHARE, activations, dense_down, dense_ffn_block, ffn_batch_block,  # noqa: E402
                          ffn_block, ffn_neurons, gather_values, masked_activation, predicted_set, predictor, relu_,
                          round_q8_0, sparse_ffn, sparse_ffn_batch, sparse_ffn_batch_chunk, sparse_ffn_chunk,
                          union_mask)
from fast.cpu.matmul import MATMUL_CHUNKS, matmul  # noqa: E402
from fast.cpu.step import StepLayer, StepModel, StepSets, decode_step, decode_steps  # noqa: E402
from fast.cpu.thin import add_rows, kept_py, sparse_rows, sparse_rows_chunk, thin, thin_activations  # noqa: E402

__all__ = ["BLOCK", "BLOCKS", "CATS", "FASTMATH", "KINDS", "MATMUL_CHUNKS", "TILE_SHARE", "StepLayer", "StepModel",
           "StepSets", "activation", "activation_py", "activations", "add_bias", "add_rows", "attend", "attention",
           "attention_block", "causal_logits", "chunk_bounds", "copy_rows", "decode_attention", "decode_attention_block",
           "decode_step", "decode_steps", "dense_down", "dense_ffn_block", "embed", "exp_le0", "ffn_batch_block", "ffn_block", "ffn_neurons",
           "gather_values", "kept_py", "layernorm", "masked_activation", "matmul", "merge_items", "norm",
           "normalize_rows", "predicted_set", "predictor", "prefetch", "prefetch_row", "prefetch_rows", "qk_norm",
           "qkv_proj", "read_bandwidth_probe", "relu_", "rmsnorm", "rope", "round_q8_0", "self_attention", "SPLIT",
           "sparse_ffn", "sparse_ffn_batch", "sparse_ffn_batch_chunk", "sparse_ffn_chunk", "sparse_rows",
           "sparse_rows_chunk", "store_kv", "sum_chunks", "thin", "thin_activations", "union_mask"]
