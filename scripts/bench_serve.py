"""Load benchmark of `python -m fast.serve`: one streaming client alone, then C concurrent streaming clients, each
asking for N tokens (ignore_eos, so every client gets all N); time to first token and inter-token latency per token
as the client sees them; optionally R sequential requests with the server's resident memory after the first 50 and
after all. With --shared-prefix P every prompt begins with the same P tokens (a system prompt), and each round runs
both ways, `cache_prompt` false (cold) and true (the prefix cache): TTFT of one client and tok/s of C clients, cold
against cached. Starts its own server on a free port (or measures --url). Prints a table; --json writes the
numbers."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


async def read_stream(host: str, port: int, prefix: str, head: str, body: bytes) -> tuple[list, str | None, int]:
    """POST body to PREFIX/v1/completions and read its event stream: (the times of the events with text, the error
    event's message or None, the completion tokens of the usage event). An answer other than 200 is an error."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST {prefix}/v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
                     f"{head}\r\n".encode() + body)
        status, *fields = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        code = int(status.split()[1])
        if code != 200:
            return [], f"HTTP {code}: {(await reader.read())[:200]!r}", 0
        chunked = any(f.lower().replace(" ", "") == "transfer-encoding:chunked" for f in fields)
        stamps, error, tokens, buf = [], None, 0, b""
        while error is None:
            if chunked:  # one chunk: its size in hex, the bytes, CRLF; size 0 ends the body
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                buf += (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(1 << 16)
                if not data:
                    break
                buf += data
            *events, buf = buf.split(b"\n\n")
            for line in events:
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                    break
                if event["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return stamps, error, tokens
    finally:
        writer.close()


async def stream_one(host: str, port: int, headers: dict, prompt: str, n: int, seed: int, prefix: str = "",
                     timeout: float = 600, cache_prompt: bool = True) -> dict:
    """One streaming completion: seconds to the first token and between tokens, tokens, wall seconds.

    HTTP/1.1 and the event stream read off an asyncio socket here, not through an HTTP client library: the load
    generator runs on the server's cores, and httpx's streaming took 130 us of CPU a token (a quarter of a core at
    16 clients, taken from the server it measures), this 30 us. A request that fails, or does not end within
    `timeout` seconds, comes back as {"error": ...}."""
    body = json.dumps({"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True, "temperature": 0.8,
                       "seed": seed, "cache_prompt": cache_prompt}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            stamps, error, tokens = await read_stream(host, port, prefix, head, body)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if error or not stamps:
        return {"error": error or "no tokens"}
    return {"ttft": stamps[0] - t0, "itl": list(np.diff(stamps)), "tokens": tokens, "seconds": end - t0}


async def load(url: str, headers: dict, clients: int, tokens: int, rounds: int, shared: str = "",
               ways: tuple = (True,)) -> dict:
    """`rounds` times, each way of `ways` (cache_prompt true, false): one client alone, then `clients` at once, as
    asyncio tasks of this one process (threads in Python would measure the load generator); every prompt begins with
    `shared`. Interleaved rounds, since a shared machine's speed drifts within a minute. {way: [(alone, runs, wall)]}"""
    where = urlsplit(url)
    if where.scheme != "http" or not where.hostname:
        raise SystemExit(f"--url: an http://host:port address, got {url!r}")
    host, port, prefix = where.hostname, where.port or 80, where.path.rstrip("/")
    out = {way: [] for way in ways}
    await stream_one(host, port, headers, shared + "warm up", 4, 0, prefix)  # the shared prefix cached
    for k in range(rounds):
        for way in ways:
            alone = await stream_one(host, port, headers, shared + f"once upon a time, round {k}", tokens, 1 + k,
                                     prefix, cache_prompt=way)
            t0 = time.perf_counter()
            runs = await asyncio.gather(*[stream_one(host, port, headers, shared + f"once upon a time, story {i}",
                                                     tokens, i + 100 * k, prefix, cache_prompt=way)
                                          for i in range(clients)])
            out[way].append((alone, runs, time.perf_counter() - t0))
    return out


def run_loop(coro):
    """Run coro on uvloop where installed (the server extra brings it: a cheaper loop for the load generator too)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_text(url: str, headers: dict, n: int) -> str:
    """About n tokens of the validation text, cut at a token boundary by the server's own tokenizer."""
    import httpx
    text = (ROOT / "data" / "corpus" / "val.txt").read_text()[:16 * n]
    ids = httpx.post(url + "/tokenize", json={"content": text}, headers=headers, timeout=60).json()["tokens"]
    if len(ids) < n:
        raise SystemExit(f"--shared-prefix {n}: the validation text gives only {len(ids)} tokens")
    return httpx.post(url + "/detokenize", json={"tokens": ids[:n]}, headers=headers, timeout=60).json()["content"]


def summary(rounds_: list) -> dict:
    """Medians over rounds of (alone, runs, wall): one client's tok/s and TTFT, the clients' aggregate tok/s, TTFT
    and inter-token latency percentiles."""
    if any("error" in alone for alone, _, _ in rounds_):
        raise SystemExit(f"one client alone failed: {next(a for a, _, _ in rounds_ if 'error' in a)['error']}")
    ok = [r for _, runs, _ in rounds_ for r in runs if "error" not in r]
    one = [alone["tokens"] / alone["seconds"] for alone, _, _ in rounds_]
    agg = [sum(r["tokens"] for r in runs if "error" not in r) / wall for _, runs, wall in rounds_]
    ttft = np.array([r["ttft"] for r in ok]) * 1e3
    itl = np.concatenate([r["itl"] for r in ok]) * 1e3 if ok else np.zeros(1)
    return {"failed": sum(len(runs) for _, runs, _ in rounds_) - len(ok),
            "one_client_tok_s": float(np.median(one)), "aggregate_tok_s": float(np.median(agg)),
            "scaling": float(np.median(np.divide(agg, one))), "runs": {"one_client_tok_s": one, "aggregate_tok_s": agg},
            "one_client_ttft_ms": float(np.median([alone["ttft"] for alone, _, _ in rounds_]) * 1e3),
            "one_client_itl_ms": float(np.median(np.concatenate([alone["itl"] for alone, _, _ in rounds_])) * 1e3),
            "ttft_ms": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99))},
            "itl_ms": {"p50": float(np.percentile(itl, 50)), "p99": float(np.percentile(itl, 99))}}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", default=None, help="Measure this server instead of starting one.")
@click.option("--model", default=None, help="Model for the server it starts [default: the shipped model].")
@click.option("-np", "--parallel", "slots", type=int, default=16, show_default=True)
@click.option("-t", "--threads", type=int, default=None)
@click.option("--clients", type=int, default=16, show_default=True)
@click.option("--tokens", type=int, default=64, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds of one client alone then the concurrent clients; tok/s and the scaling are their medians.")
@click.option("--shared-prefix", type=click.IntRange(min=0), default=0, show_default=True,
              help="Tokens every prompt begins with; each round then runs cold (cache_prompt false) and cached.")
@click.option("--cache-ram", type=float, default=None, help="The started server's --cache-ram (MiB).")
@click.option("--sequential", type=int, default=0, show_default=True,
              help="Also send this many requests one after another and compare resident memory (0: no).")
@click.option("--api-key", default=None)
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None)
def main(url, model, slots, threads, clients, tokens, rounds, shared_prefix, cache_ram, sequential, api_key,
         json_file):
    """Aggregate tok/s of concurrent streaming clients against one alone, with latency percentiles."""
    import httpx
    proc = None
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "fast.serve", *([model] if model else []), "--port", str(port), "-np", str(slots),
               "--max-queue", str(max(clients, 64)), *(["-t", str(threads)] if threads else []),
               *(["--cache-ram", str(cache_ram)] if cache_ram is not None else []),
               *(["--api-key", api_key] if api_key else [])]
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server did not start: {proc.stderr.read() if proc.poll() is not None else 'timeout'}")
            time.sleep(0.2)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        shared = shared_text(url, headers, shared_prefix) if shared_prefix else ""
        ways = (False, True) if shared_prefix else (True,)
        by_way = {way: summary(r) for way, r in run_loop(load(url, headers, clients, tokens, rounds, shared,
                                                                ways)).items()}
        out = {"clients": clients, "tokens": tokens, "slots": slots, "rounds": rounds, "shared_prefix": shared_prefix,
               **by_way[True]}
        if sequential and proc is not None:
            rss = {}
            for i in range(sequential):
                httpx.post(url + "/v1/completions", json={"prompt": f"request {i}", "max_tokens": 8}, headers=headers,
                           timeout=120)
                if i + 1 in (50, sequential):
                    rss[i + 1] = rss_kib(proc.pid)
            out["rss_kib"] = rss
            out["rss_growth"] = rss[sequential] / rss[min(50, sequential)] - 1
        click.echo("| test | clients | tokens each | failed | tok/s | x one client | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
        click.echo("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for way, m in by_way.items():
            name = "" if not shared_prefix else ", cached" if way else ", cold"
            click.echo(f"| one client{name} | 1 | {tokens} | 0 | {m['one_client_tok_s']:.1f} | 1.00 | "
                       f"{m['one_client_ttft_ms']:.1f} | {m['one_client_itl_ms']:.1f} |")
            click.echo(f"| concurrent{name} | {clients} | {tokens} | {m['failed']} | {m['aggregate_tok_s']:.1f} | "
                       f"{m['scaling']:.2f} | {m['ttft_ms']['p50']:.1f} / {m['ttft_ms']['p99']:.1f} | "
                       f"{m['itl_ms']['p50']:.1f} / {m['itl_ms']['p99']:.1f} |")
        one, agg = out["runs"]["one_client_tok_s"], out["runs"]["aggregate_tok_s"]
        click.echo(f"medians of {rounds} interleaved rounds; one client {min(one):.0f} to {max(one):.0f} tok/s, "
                   f"{clients} clients {min(agg):.0f} to {max(agg):.0f}; x one client is the median of the rounds' ratios")
        if shared_prefix:
            cold, warm = by_way[False], by_way[True]
            out["cold"] = cold
            out["cached_vs_cold"] = {"one_client_ttft": warm["one_client_ttft_ms"] / cold["one_client_ttft_ms"],
                                     "aggregate_tok_s": warm["aggregate_tok_s"] / cold["aggregate_tok_s"]}
            metrics = httpx.get(url + "/metrics", headers=headers, timeout=60).text
            out["prefix_cache_bytes"] = int(float(next(line.split()[-1] for line in metrics.splitlines()
                                                       if line.startswith("powerinfer_py:prefix_cache_bytes"))))
            click.echo(f"shared prefix of {shared_prefix} tokens: cached/cold TTFT of one client "
                       f"{out['cached_vs_cold']['one_client_ttft']:.2f}x, {clients} clients' tok/s "
                       f"{out['cached_vs_cold']['aggregate_tok_s']:.2f}x; the prefix cache holds "
                       f"{out['prefix_cache_bytes'] / 2**20:.1f} MiB")
        if "rss_kib" in out:
            click.echo(f"resident memory after 50 requests {out['rss_kib'][min(50, sequential)] / 1024:.1f} MiB, after "
                       f"{sequential}: {out['rss_kib'][sequential] / 1024:.1f} MiB ({out['rss_growth']:+.1%})")
        if json_file:
            json_file.write_text(json.dumps(out, indent=2) + "\n")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
