"""The server's per-token pieces against their plain definitions: fast.server.sampling's batched sampler against
ref.common.sampling.sample, and TextStream's incremental text against decoding every id."""

import numpy as np
import pytest

from fast.server.sampling import sample
from fast.server.scheduler import Params, Request, Scheduler, TextStream
from ref.common.sampling import penalties, processed, sample as ref_sample
from ref.common.tokenizer import load_tokenizer
from tests.helpers import FAMILIES, SHIPPED, Ban, serve_requests, write_gguf


class Draw:
    """An rng whose one draw is given: ref's sample and fast's then see the same u."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("V, ties", [(1, False), (7, False), (40, True), (41, False), (300, True), (4096, False)])
def test_sampler_matches_ref(V, ties, dtype):
    """Rows in float64 (penalized) and in float32 (the model's logits as they come) give ref's tokens."""
    rng = np.random.default_rng(V)
    B = 64
    z = rng.standard_normal((B, V)) * rng.uniform(0.1, 5, (B, 1))  # [B, V]
    if ties:
        z = np.round(z)
    z = z.astype(dtype)
    temperature = rng.choice([0.0, 0.3, 0.8, 1.5], B)
    top_k = rng.choice([0, 1, 5, 40, V, V + 3], B)
    top_p = rng.choice([0.3, 0.9, 0.95, 1.0], B)
    min_p = rng.choice([0.0, 0.05, 0.3, 1.0], B)
    u = rng.random(B)
    out = np.full(B, -1, np.int64)
    sample(out, z, u, temperature, top_k, top_p, min_p)
    expected = [ref_sample(z[b], Draw(u[b]), temperature[b], top_k[b], top_p[b], min_p[b]) for b in range(B)]
    assert out.tolist() == expected


def test_sampler_of_no_rows():
    """A step with no row to sample (every request finished): nothing drawn, nothing written past the rows."""
    out = np.full(1, -7, np.int64)
    sample(out[:0], np.zeros((0, 5)), np.zeros(0), np.zeros(0), np.zeros(0, np.int64), np.ones(0), np.zeros(0))
    assert out.tolist() == [-7]


def test_scheduler_samples_each_request_as_ref_does():
    """A step's rows sampled at once, each with its own penalties (repeat over the last n of prompt and output,
    presence and frequency over the output), settings and seed: the tokens ref's sampler gives one by one. In the
    first four rows a penalty (or its window) decides the greedy token."""
    rng = np.random.default_rng(3)
    V = 50
    settings = [Params(temperature=0.0, repeat_penalty=2.0), Params(temperature=0.0, presence_penalty=1.5),
                Params(temperature=0.0, frequency_penalty=0.4), Params(temperature=0.0, repeat_penalty=2.0,
                repeat_last_n=3), Params(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=1),
                Params(temperature=0.7, top_k=0, top_p=0.5, seed=2), Params(temperature=1.2, min_p=0.2,
                repeat_penalty=0.8, repeat_last_n=3, seed=3), Params(temperature=0.5, top_k=3, seed=5)]
    logits = (rng.standard_normal((len(settings), V))).astype(np.float32)  # [B, V]
    histories = {0: ([7], [1, 2]), 1: ([0], [9, 3]), 2: ([0], [11, 11, 11]), 3: ([13], [1, 2, 3])}
    reqs = []
    for b, p in enumerate(settings):
        r = Request([int(i) for i in rng.integers(0, V, 5)], p, None)
        r.out, r.rng = [int(i) for i in rng.integers(0, V, 7)], np.random.default_rng(p.seed)
        if b in histories:  # token 7 + 2b leads by 1, the next one is second, and the history decides
            logits[b, 7 + 2 * b], logits[b, 8 + 2 * b] = 10.0, 9.0
            r.prompt, r.out = histories[b]
        reqs.append(r)
    want = [ref_sample(processed(penalties(p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty),
                                 z, r.prompt, r.out), np.random.default_rng(p.seed), p.temperature, p.top_k, p.top_p,
                       p.min_p) for r, p, z in ((r, r.params, z) for r, z in zip(reqs, logits))]
    assert want[:4] == [8, 10, 12, 13]
    assert Scheduler.sample(reqs, logits).tolist() == want
    assert Scheduler.sample([], logits[:0]).shape == (0,)  # a step of prompt chunks only samples nothing


def spm_model(folder) -> str:
    """A GGUF with only a SentencePiece tokenizer (llama.cpp's 'llama' kind): its decoder strips one leading space,
    '▁' alone decodes to nothing at the start of a text, and é comes in two byte tokens."""
    pieces = ["<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", "\u2581", "\u2581\u2581", "a", "\u2581a", "\u2581cat", "x"]
    types = [2, 3, 3, 6, 6] + [1] * (len(pieces) - 5)  # UNKNOWN, CONTROL, BYTE, NORMAL
    return write_gguf(folder / "spm.gguf", tokenizer_model="llama", token_list=pieces, token_scores=[0.0] * len(pieces),
                      token_types=types, bos_token_id=1, eos_token_id=2, unk_token_id=0)


@pytest.mark.parametrize("model", ["byte-level", "opt", "falcon", "sentencepiece"])
def test_text_stream_is_the_decoded_ids(model, tmp_path):
    """Random ids, with special tokens, lone spaces and multi-byte characters over-represented: after each token
    whose text ends in whole characters, the stream's text is decode(all ids). SentencePiece's byte pieces come as
    whole UTF-8 characters: it decodes a run of them that is not UTF-8 as one U+FFFD per byte, text already shown
    included, which no stream can follow."""
    tok = load_tokenizer({"byte-level": SHIPPED, "opt": FAMILIES / "opt-pre-ln", "falcon": FAMILIES / "falcon-gqa",
                          "sentencepiece": None}[model] or spm_model(tmp_path))
    vocab = tok.tok.get_vocab()
    pieces = [[i] for t, i in vocab.items() if not t.startswith("<0x")]
    odd = [[i] for t, i in vocab.items() if t.startswith("<") and not t.startswith("<0x") or t in ("▁", "Ġ", " ")]
    odd += [[vocab[b] for b in bs] for bs in (["<0xC3>", "<0xA9>"], ["\u00c3", "\u00a9"])  # é as two bytes
            if all(b in vocab for b in bs)]
    rng = np.random.default_rng(0)
    for _ in range(20):
        stream = TextStream(tok, ())
        shown = ""
        for _ in range(60):
            unit = odd[rng.integers(len(odd))] if rng.random() < 0.4 else pieces[rng.integers(len(pieces))]
            for t in unit:
                piece, stopped = stream.add(t)
                shown += piece
                assert not stopped
                whole = tok.decode(stream.ids)
                if not whole.endswith("\ufffd"):
                    assert stream.text == whole and shown == whole
        assert shown + stream.flush() == stream.text


def test_text_stream_cuts_a_stop_string_across_tokens():
    tok = load_tokenizer(SHIPPED)
    ids = tok.encode("Once upon a time there was a little dog")[1:]
    stream = TextStream(tok, ("a little",))
    shown, stopped = "", False
    for t in ids:
        piece, stopped = stream.add(t)
        shown += piece
        if stopped:
            break
    whole = tok.decode(ids)
    assert stopped and shown == whole[:whole.index("a little")] and shown.endswith("there was ")


class PoisonedEngine:
    """An engine whose forward fails on any batch holding token `poison`, as a request's bad input might."""

    def __init__(self, engine, poison: int):
        self.engine, self.poison = engine, poison
        self.config, self.new_cache = engine.config, engine.new_cache

    def forward(self, batch, cache):
        if self.poison in batch.tokens:
            raise ValueError("poisoned batch")
        return self.engine.forward(batch, cache)


@pytest.mark.parametrize("poison", ["sampling", "forward"])
def test_a_failing_request_fails_alone(poison):
    """A request that fails on the engine thread (its sampler overflows: top_k 10**20; the forward of its batch
    raises) gets an error event; the three beside it finish with the tokens they get alone."""
    from fast.load import load_engine
    tok = load_tokenizer(SHIPPED)
    engine = load_engine(SHIPPED, threads=1)
    if poison == "forward":
        engine = PoisonedEngine(engine, 7)
    greedy = Params(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [tok.encode(p) for p in ("Once upon a time", "The dog", "She said")]
    assert not any(7 in p for p in prompts)
    bad = Request(prompts[0] + [7], greedy, None) if poison == "forward" else Request(
        prompts[1], Params(top_k=10**20, max_tokens=12), None)

    def run(requests):
        sched = Scheduler(lambda: (engine, tok), slots=4, ctx_size=64).start()
        events = serve_requests(sched, requests)
        sched.stop()
        return events

    alone = [run([Request(p, greedy, None)])[0] for p in prompts]
    together = run([Request(p, greedy, None) for p in prompts[:2]] + [bad] + [Request(prompts[2], greedy, None)])
    assert together[2][-1][0] == "error" and ("poisoned" if poison == "forward" else "Overflow") in together[2][-1][1]
    for got, want in zip(together[:2] + together[3:], alone):
        assert got[-1][0] == "done" and got[-1][2]["completion_tokens"] == 12
        assert [e[:2] for e in got[:-1]] == [e[:2] for e in want[:-1]]


def test_a_requests_logits_processor_changes_its_tokens_alone():
    """A request's own processor (ref.common.sampling.Processor) changes its tokens and hears each one it takes; the
    request beside it gives its tokens alone."""
    from fast.load import load_engine
    tok = load_tokenizer(SHIPPED)
    engine = load_engine(SHIPPED, threads=1)
    greedy, prompt = Params(temperature=0.0, max_tokens=10, ignore_eos=True), tok.encode("Once upon a time")

    def run(reqs):
        sched = Scheduler(lambda: (engine, tok), slots=2, ctx_size=64).start()
        serve_requests(sched, reqs)
        sched.stop()
        return [r.out for r in reqs]

    [alone] = run([Request(prompt, greedy, None)])
    banned = Request(prompt, greedy, None)
    banned.processors.append(ban := Ban(alone[0]))
    got, beside = run([banned, Request(prompt, greedy, None)])
    assert beside == alone and alone[0] not in got and ban.seen == got and len(got) == 10


@pytest.mark.parametrize("kv, sparse, gemm", [("f32", False, False), ("f16", True, False), ("bf16", False, True),
                                              ("q8_0", False, False), ("q8_0", True, False), ("q8_0", True, True)])
def test_a_seeded_request_gives_the_same_text_alone_beside_others_and_again(kv, sparse, gemm, monkeypatch):
    """Seeded sampling (temperature 0.9), prompts of 15 to 250 tokens, 120 tokens each: each request's text alone;
    then all eight at once in four slots (later ones arriving while others decode, prompt chunks beside decodes);
    then all eight again, their prompts from the prefix cache: the same text each time, in every KV format. With
    `gemm` the engine would run a chunk of two tokens or more in fast.blas's GEMMs (as a wide model's prompt); the
    server turns that off."""
    import fast.blas
    import fast.layers
    from fast.load import load_engine
    if gemm:
        monkeypatch.setattr(fast.blas, "MIN_TOKENS", 2)
        monkeypatch.setattr(fast.blas, "MIN_WORK", 0)
        monkeypatch.setattr(fast.blas, "GEMM_TOKENS", 2)
        monkeypatch.setattr(fast.layers, "GEMM_SHARE", 0.0)
    tok = load_tokenizer(SHIPPED)
    engine = load_engine(SHIPPED, threads=2, predictors=SHIPPED / "predictors.safetensors" if sparse else None,
                         cache_types=(kv, kv))
    assert (engine.kernels(64, 256) is fast.blas) == gemm
    text = (SHIPPED.parent / "corpus" / "val.txt").read_text()
    prompts = [tok.encode(text[300 * i:300 * i + n]) for i, n in enumerate([60, 700, 330, 900, 200, 450, 120, 520])]

    def requests():
        return [Request(p, Params(temperature=0.9, seed=i, max_tokens=120, ignore_eos=True), None)
                for i, p in enumerate(prompts)]

    def texts(rounds, cache_ram=0):
        sched = Scheduler(lambda: (engine, tok), slots=4, ctx_size=400, batch_size=96, cache_ram=cache_ram).start()
        out = [[e[-1][2]["text"] for e in serve_requests(sched, reqs)] for reqs in rounds]
        sched.stop()
        return out, sched.metrics["prompt_tokens_cached_total"]

    alone = [texts([[r]])[0][0][0] for r in requests()]
    assert len(set(alone)) == len(alone)
    (beside, again), cached = texts([requests(), requests()], cache_ram=64)
    assert beside == alone
    assert again == alone
    assert cached >= sum(len(p) - 1 for p in prompts)  # the second round's
