"""A decode step of every layer as one compiled call (decode_step; decode_steps for several sequences), over a typed
list of StepLayer."""

from collections import namedtuple

import numpy as np
from numba import njit

from fast.quant import n_rows
from fast.cpu.base import BLOCKS, norm
from fast.cpu.matmul import matmul
from fast.cpu.attention import attention_block, decode_attention_block
from fast.cpu.ffn import ffn_batch_block, ffn_block, predicted_set, predictor
from fast.quant.target import ERROR_MODEL


# One layer of a decode step as cpu.decode_step reads it (fast.engine.Engine.step_rows builds a typed list of them, by
# name): the norms' weights and biases before attention, before the FFN, after attention and after the FFN (EMPTY
# where the block has none), the attention's and the FFN's arrays (fast.layers' Fused.step_fields and
# Bundles.step_fields), the predictor (fc1, fc2: no rows where there is none), and the layer's key and value slots
# (typed lists: [seq] -> [K, room, E]).
StepLayer = namedtuple("StepLayer", ["attn_w", "attn_b", "ffn_w", "ffn_b", "post_attn_w", "post_attn_b", "post_ffn_w",
                                     "post_ffn_b", "wqkv", "bqkv", "qk_norms", "wo", "bo", "bundle", "bu", "bd", "fc1",
                                     "fc2", "k_slots", "v_slots"])
# What a step reads beside its layers, fixed while the engine's layers are: RoPE's tables, the norms' eps, the per-chunk
# accumulators [C, D], the FFN's kind and threshold (cpu.KINDS), the block's code (BLOCKS), the final norm's weight and
# bias and the output head (Engine.output).
StepModel = namedtuple("StepModel", ["cos", "sin", "eps", "acc", "kind", "thr", "block", "out_w", "out_b", "lm_head"])
# A step's FFN sets where no predictor's threshold decides them (step_ffn): one token's given sets of every layer and
# their bounds, or several tokens' picks [L, T, F]; and the predictor's threshold.
StepSets = namedtuple("StepSets", ["threshold", "given", "bounds", "picks"])
PARALLEL = BLOCKS["parallel"]


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def decode_step(out, h, layers, seqs, positions, sets, model):
    """One new token of sequence seqs[0] at positions[0] through every block, in place on its residual stream h [1, D]
    (step_blocks with attention_block), and where `out` has rows the output head: logits out [1, V].
    layers: a typed list of StepLayer; sets: StepSets; model: StepModel.

    One compiled call per step instead of four per layer from Python: once a token's weights have streamed through
    the caches, each return to the interpreter runs from memory (TinyLlama q4_0: 1.2 ms of an 11.2 ms token were
    outside the kernels). One typed list, since numba types a tuple of typed lists slowly (80 us a call against 1 us)
    and unboxes each typed list argument from cold code after a read pass (about 33 us each); the output head runs
    here where it can, for the same reason. One sequence's step and several sequences' (decode_steps) compile apart:
    a run that decodes one sequence does not compile the other's attention."""
    step_blocks(out, h, layers, seqs, positions, sets, model, one_attention)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def decode_steps(out, h, layers, seqs, positions, sets, model):
    """decode_step for one new token of each of T sequences (token t of sequence seqs[t] at positions[t]), h [T, D]:
    step_blocks with decode_attention_block, out [T, V] or no rows."""
    step_blocks(out, h, layers, seqs, positions, sets, model, batch_attention)


@njit(inline="always")
def step_blocks(out, h, layers, seqs, positions, sets, M, attention):
    """Every block on the residual streams h [T, D], in place (fast.engine's pre_norm_block, post_norm_block or
    parallel_block by M.block): `attention` (one_attention or batch_attention), then the FFN over each token's set
    (step_ffn); then, where `out` has rows, the output head: out = lm_head . norm(h) (Engine.output)."""
    F = layers[0].bundle.shape[0]  # the bundle's neurons
    a, y = np.empty_like(h), np.empty_like(h)  # [T, D]
    logits, active = np.empty((1, F), np.float32), np.empty(F, np.int32)
    for l in range(len(layers)):
        L = layers[l]
        if M.block == PARALLEL:  # the FFN reads the layer input too
            step_ffn(y, h, l, L, sets, logits, active, M)
        attention(a, h, L, seqs, positions, M)
        h += a
        norm(h, h, L.post_attn_w, L.post_attn_b, M.eps)
        if M.block != PARALLEL:
            step_ffn(y, h, l, L, sets, logits, active, M)
        h += y
        norm(h, h, L.post_ffn_w, L.post_ffn_b, M.eps)
    if out.shape[0]:
        x = np.empty_like(h)
        norm(x, h, M.out_w, M.out_b, M.eps)
        matmul(out, x, M.lm_head)


# The attention steps are inlined where step_blocks is: numba generates a compiled function's code together with that
# of everything it calls, so a level of their own would generate attention_block's whole code once more (2 s of a
# cold start).
@njit(inline="always")
def one_attention(a, h, L, seqs, positions, M):
    """a = layer L's attention_block for one sequence's token h [1, D]."""
    attention_block(a, h, L.attn_w, L.attn_b, L.wqkv, L.bqkv, L.qk_norms, L.wo, L.bo, L.k_slots[seqs[0]],
                    L.v_slots[seqs[0]], M.cos, M.sin, positions[0], M.eps)


@njit(inline="always")
def batch_attention(a, h, L, seqs, positions, M):
    """a = layer L's decode_attention_block for one token of each of T sequences, h [T, D]."""
    decode_attention_block(a, h, L.attn_w, L.attn_b, L.wqkv, L.bqkv, L.qk_norms, L.wo, L.bo, L.k_slots, L.v_slots,
                           seqs, positions, M.cos, M.sin, M.eps)


@njit(cache=True, nogil=True, fastmath=False, error_model=ERROR_MODEL)
def step_ffn(y, h, l, L, sets, logits, active, M):
    """y = the FFN block of layer l (L, a StepLayer) of h [T, D] over each token's set: one token's ffn_block over
    the predictor's threshold where sets.bounds is empty, else over layer l's given set given[bounds[l]:bounds[l +
    1]] (a pick that does not read the logits; the predictor still runs where there is one); several tokens'
    ffn_batch_block over picks[l] [T, F], or the threshold where it has no rows (picks [L, 0, 0])."""
    if h.shape[0] > 1:
        ffn_batch_block(y, h, L.ffn_w, L.ffn_b, L.fc1, L.fc2, sets.threshold, sets.picks[l], L.bundle, L.bu, L.bd,
                        M.acc.shape[0], M.kind, M.thr, M.eps)
        return
    if L.fc1.shape[0]:
        predictor(logits, np.empty((1, n_rows(L.fc1)), np.float32), h, L.fc1, L.fc2)
    if len(sets.bounds):
        ids = sets.given[sets.bounds[l]:sets.bounds[l + 1]]
        n = len(ids)
    else:
        ids = active
        n = predicted_set(active, logits[0], sets.threshold)
    ffn_block(y[0], M.acc, h[0], L.ffn_w, L.ffn_b, L.bundle, L.bu, L.bd, ids, n, M.kind, M.thr, M.eps)
