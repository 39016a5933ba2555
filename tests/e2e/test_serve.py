"""`python -m fast.serve` as clients use it: a real server process on 127.0.0.1, the official openai client and httpx;
OpenAI's wire format, continuous batching, the queue, disconnects and bad input (4xx, and the next request served)."""

import concurrent.futures
import json
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, SHIPPED_SILU

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from tests.e2e.server import ServerProcess, free_port  # noqa: E402  (needs httpx)

MODEL = "tiny-relu-llama"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("-np", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def fast_run_text(prompt: str, n: int) -> str:
    r = subprocess.run([sys.executable, "-m", "fast.run", "-p", prompt, "-n", str(n), "--temp", "0", "-t", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    text = r.stdout[len(prompt):-1]  # fast.run ends its output with a newline
    return text.removesuffix(" [end of text]")


def test_greedy_completion_equals_fast_run_streamed_or_not(client):
    prompt = "once upon a time"
    want = fast_run_text(prompt, 24)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == want
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 3
    assert whole.choices[0].finish_reason in ("length", "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                                             temperature=0, stream=True))
    assert streamed == whole.choices[0].text


def test_chat_stream_chunks_and_usage(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12,
            "stream": True, "seed": 3}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and last["usage"]["completion_tokens"] <= 12
    assert last["timings"]["predicted_n"] == last["usage"]["completion_tokens"]


def test_a_repeated_prompt_comes_from_the_prefix_cache(client, server):
    """The same prompt again: all but its last token restored (usage's cached_tokens, llama.cpp's timings), the same
    greedy text; with cache_prompt false, none restored."""
    prompt = (ROOT / "data" / "corpus" / "val.txt").read_text()[:600]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    n = first.usage.prompt_tokens
    again = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
                       timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert again["timings"]["cache_n"] == n - 1 and again["timings"]["prompt_n"] == 1
    assert again["choices"][0]["text"] == first.choices[0].text
    cold = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"cache_prompt": False})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0 and cold.choices[0].text == first.choices[0].text
    metrics = dict(line.split() for line in httpx.get(server.url + "/metrics").text.splitlines()
                   if line.startswith("powerinfer_py:"))
    assert float(metrics["powerinfer_py:prompt_tokens_cached_total"]) >= n - 1
    assert float(metrics["powerinfer_py:prefix_cache_bytes"]) > 0
    assert float(metrics["powerinfer_py:prefix_cache_errors_total"]) == 0


def test_chat_with_the_openai_client(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "You tell stories."},
                                                              {"role": "user", "content": "a dog"}],
                                       max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 10
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a dog"}], max_tokens=10, temperature=0, stream=True))
    assert isinstance(text, str)


def test_stop_strings_are_cut(client):
    full = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=30, temperature=0).choices[0].text
    words = full.split()
    assert len(words) > 4
    stop = " " + words[3]
    r = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_same_seed_same_text_alone_or_beside_others(client):
    kw = dict(model=MODEL, prompt="the little bird", max_tokens=16, temperature=1.0, seed=1234)
    alone = client.completions.create(**kw).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(client.completions.create, model=MODEL, prompt=p, max_tokens=16, temperature=1.0)
                  for p in ("a cat", "the sun was", "one day")]
        beside = pool.submit(client.completions.create, **kw)
        assert beside.result().choices[0].text == alone
        assert all(o.result().choices[0].text is not None for o in others)


def test_concurrent_requests_all_finish(client):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: client.completions.create(model=MODEL, prompt=f"story {i}", max_tokens=8,
                                                                    temperature=0), range(8)))
    assert all(r.usage.completion_tokens >= 1 for r in results)


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert all(len(e.top_logprobs) == 2 for e in c.choices[0].logprobs.content)


def test_models_health_metrics_tokenize(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL
    before = httpx.get(server.url + "/metrics").text
    httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
    after = httpx.get(server.url + "/metrics").text

    def value(text, name):
        return float(next(l.split()[-1] for l in text.splitlines() if l.startswith(f"powerinfer_py:{name} ")))
    assert value(after, "requests_total") == value(before, "requests_total") + 1
    assert value(after, "tokens_predicted_total") > value(before, "tokens_predicted_total")
    toks = httpx.post(server.url + "/tokenize", json={"content": "once upon a time"}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": toks}).json()["content"] == "once upon a time"
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text


def test_disconnect_mid_stream_frees_the_slot(server):
    def busy():
        text = httpx.get(server.url + "/metrics").text
        return float(next(l.split()[-1] for l in text.splitlines() if l.startswith("powerinfer_py:requests_processing ")))
    body = {"prompt": "once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            break  # one event, then the client goes away
    deadline = time.time() + 10
    while busy() and time.time() < deadline:
        time.sleep(0.05)
    assert busy() == 0


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "model": 4}, 400, "model"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 1}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "messages"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_requests_get_4xx_and_the_server_goes_on(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"code", "message", "type"} and err["message"]
    if param:
        assert err["param"] == param
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200


def test_any_model_name_is_this_servers_model(server):
    """A client's default name (gpt-4o-mini, say) gets this server's model, as llama-server does."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "gpt-4o-mini"},
                   timeout=60)
    assert r.status_code == 200, r.text


def test_api_key_and_the_full_queue():
    s = ServerProcess("-np", "1", "--max-queue", "1", "--api-key", "sekret")
    try:
        assert httpx.get(s.url + "/health").status_code == 200  # open, for load balancers
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        wrong = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        auth = {"Authorization": "Bearer sekret"}
        long = {"prompt": "once upon a time", "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # one runs, one waits, the others find the queue full
            answers = list(pool.map(lambda _: httpx.post(s.url + "/v1/completions", json=long, headers=auth,
                                                         timeout=120), range(6)))
        codes = sorted(a.status_code for a in answers)
        assert codes[:2] == [200, 200] and set(codes) == {200, 503}, codes
        for a in answers:
            if a.status_code == 503:
                assert a.headers["retry-after"] == "1" and a.json()["error"]["type"] == "unavailable_error"
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth,
                          timeout=60).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("args, message", [
    (["-np", "0"], "error: -np/--parallel must be >= 1"),
    (["--context-shift", "--keep", "-2"], "error: --keep must be >= 0, or -1 (the whole prompt), got -2"),
    (["-c", "99999"], "error: -c/--ctx-size 99999 exceeds the model's context of 512"),
    (["--cache-ram", "-1"], "error: --cache-ram must be >= 0 MiB (0: no prefix cache), got -1"),
    (["/nonexistent"], "error: MODEL_DIR /nonexistent: no such folder or file"),
    ([], "error: --host 127.0.0.1 --port {busy}: cannot listen there"),
])
def test_bad_flags_are_one_line(server, args, message):
    busy = server.port
    port = [] if not args else ["--port", str(free_port())]
    r = subprocess.run([sys.executable, "-m", "fast.serve", *args, *(port or ["--port", str(busy)])],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(message.format(busy=busy)), r.stderr
    assert "Traceback" not in r.stderr


def test_default_threads_are_counted_before_the_server_starts(monkeypatch):
    """Without -t the idle cores are counted on the main thread before the engine thread and uvicorn start: counted
    during their start-up, a core looked busy and a 2-core machine got 1 thread."""
    import threading

    import fast.server.app
    from fast.server.app import serving
    from tests.helpers import SHIPPED
    where = []
    monkeypatch.setattr(fast.server.app, "free_cores", lambda *a, **k: where.append(threading.current_thread()) or 1)
    server, _ = serving(SHIPPED, 1, 0, 512, 4, None, None)
    try:
        assert server.scheduler.ready.wait(120), server.scheduler.failed
        assert where == [threading.main_thread()] and server.scheduler.engine.threads == 1
    finally:
        server.scheduler.stop()


def test_the_load_generator_reads_streams_as_the_server_sends_them(server):
    """scripts/bench_serve.py reads HTTP/1.1 and the event stream off a socket itself: every token of concurrent
    streams counted, with their times; a 4xx answer, a refused connection and a server too slow for the timeout
    reported as errors."""
    import asyncio

    from tests.helpers import load_script
    bench = load_script("bench_serve")

    async def streams():
        one = bench.stream_one
        return await asyncio.gather(one("127.0.0.1", server.port, {}, "once upon a time", 12, 5),
                                    one("127.0.0.1", server.port, {}, "a dog", 7, 6),
                                    one("127.0.0.1", server.port, {"X-Ignored": "1"}, "hi", 0, 7),
                                    one("127.0.0.1", free_port(), {}, "hi", 4, 8),
                                    one("127.0.0.1", server.port, {}, "a cat", 400, 9, timeout=0.05))

    runs = asyncio.run(asyncio.wait_for(streams(), 120))
    assert [r.get("tokens") for r in runs[:2]] == [12, 7], runs
    assert all(r["ttft"] > 0 and r["seconds"] >= r["ttft"] and len(r["itl"]) <= r["tokens"] - 1 for r in runs[:2])
    assert runs[2]["error"].startswith("HTTP 400"), runs[2]
    assert runs[3]["error"].startswith("ConnectionRefusedError"), runs[3]
    assert runs[4]["error"].startswith("TimeoutError"), runs[4]


def test_activation_sparsity_serves_the_text_fast_run_gives(tmp_path):
    """The SwiGLU twin with --sparsity: three requests decoding together (the union of their kept inputs) each give
    fast.run's greedy text with the same flags; a thresholds file of another model ends the start in one line."""
    flags = ["--sparsity", "0.4", "--sparsity-method", "wina"]
    prompts = ["once upon a time", "the little dog was sad because", "tom and his mom"]
    want = []
    for p in prompts:
        r = subprocess.run([sys.executable, "-m", "fast.run", str(SHIPPED_SILU), "-p", p, "-n", "16", "--temp", "0",
                            "-t", "1", *flags], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        want.append(r.stdout[len(p):-1].removesuffix(" [end of text]"))
    s = ServerProcess(str(SHIPPED_SILU), "-np", "3", *flags)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: client.completions.create(model="m", prompt=p, max_tokens=16, temperature=0)
                                .choices[0].text, prompts))
    finally:
        s.stop()
    assert got == want
    import numpy as np
    from ref.common.artifacts import LEVELS, Thresholds
    table = np.broadcast_to(LEVELS, (2, 4, len(LEVELS))).astype(np.float32)  # a 2-layer model's
    Thresholds({"wina": table}, {}, np.zeros(0), np.array([32, 32, 32, 100]), {}).save(tmp_path / "other.safetensors")
    r = subprocess.run([sys.executable, "-m", "fast.serve", str(SHIPPED_SILU), "--port", str(free_port()), *flags,
                        "--sparsity-file", str(tmp_path / "other.safetensors")], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and "another model" in r.stderr
