"""Load benchmark of `python -m fast.serve`: one streaming client alone, then C concurrent streaming clients, each
asking for N tokens (ignore_eos, so every client gets all N); time to first token and inter-token latency per token
as the client sees them; optionally R sequential requests with the server's resident memory after the first 50 and
after all. Starts its own server on a free port (or measures --url). Prints a table; --json writes the numbers."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


async def stream_one(client, prompt: str, n: int, seed: int) -> dict:
    """One streaming completion: seconds to the first token and between tokens, tokens, wall seconds."""
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True, "temperature": 0.8, "seed": seed}
    t0 = time.perf_counter()
    stamps, error, tokens = [], None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                break
            if event["choices"][0]["text"]:
                stamps.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    if error or not stamps:
        return {"error": error or "no tokens"}
    return {"ttft": stamps[0] - t0, "itl": list(np.diff(stamps)), "tokens": tokens, "seconds": end - t0}


async def load(url: str, headers: dict, clients: int, tokens: int, rounds: int) -> list[tuple[dict, list, float]]:
    """`rounds` times: one client alone, then `clients` at once, on one asyncio HTTP client (threads in Python would
    measure the load generator). Interleaved rounds, since a shared machine's speed drifts within a minute."""
    import httpx
    limits = httpx.Limits(max_connections=clients + 1)
    out = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        await stream_one(client, "warm up", 4, 0)
        for k in range(rounds):
            alone = await stream_one(client, "once upon a time", tokens, 1 + k)
            t0 = time.perf_counter()
            runs = await asyncio.gather(*[stream_one(client, f"once upon a time, story {i}", tokens, i + 100 * k)
                                          for i in range(clients)])
            out.append((alone, runs, time.perf_counter() - t0))
    return out


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", default=None, help="Measure this server instead of starting one.")
@click.option("--model", default=None, help="Model for the server it starts [default: the shipped model].")
@click.option("-np", "--parallel", "slots", type=int, default=16, show_default=True)
@click.option("-t", "--threads", type=int, default=None)
@click.option("--clients", type=int, default=16, show_default=True)
@click.option("--tokens", type=int, default=64, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds of one client alone then the concurrent clients; tok/s and the scaling are their medians.")
@click.option("--sequential", type=int, default=0, show_default=True,
              help="Also send this many requests one after another and compare resident memory (0: no).")
@click.option("--api-key", default=None)
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None)
def main(url, model, slots, threads, clients, tokens, rounds, sequential, api_key, json_file):
    """Aggregate tok/s of concurrent streaming clients against one alone, with latency percentiles."""
    import httpx
    proc = None
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "fast.serve", *([model] if model else []), "--port", str(port), "-np", str(slots),
               "--max-queue", str(max(clients, 64)), *(["-t", str(threads)] if threads else []),
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
        rounds_ = asyncio.run(load(url, headers, clients, tokens, rounds))
        if any("error" in alone for alone, _, _ in rounds_):
            raise SystemExit(f"one client alone failed: {next(a for a, _, _ in rounds_ if 'error' in a)['error']}")
        ok = [r for _, runs, _ in rounds_ for r in runs if "error" not in r]
        failed = sum(len(runs) for _, runs, _ in rounds_) - len(ok)
        one = [alone["tokens"] / alone["seconds"] for alone, _, _ in rounds_]
        agg = [sum(r["tokens"] for r in runs if "error" not in r) / wall for _, runs, wall in rounds_]
        ttft = np.array([r["ttft"] for r in ok]) * 1e3
        itl = np.concatenate([r["itl"] for r in ok]) * 1e3 if ok else np.zeros(1)
        alone_ttft = np.median([alone["ttft"] for alone, _, _ in rounds_]) * 1e3
        alone_itl = np.median(np.concatenate([alone["itl"] for alone, _, _ in rounds_])) * 1e3
        out = {"clients": clients, "tokens": tokens, "slots": slots, "rounds": rounds, "failed": failed,
               "one_client_tok_s": float(np.median(one)), "aggregate_tok_s": float(np.median(agg)),
               "scaling": float(np.median(np.divide(agg, one))), "runs": {"one_client_tok_s": one, "aggregate_tok_s": agg},
               "ttft_ms": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99))},
               "itl_ms": {"p50": float(np.percentile(itl, 50)), "p99": float(np.percentile(itl, 99))}}
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
        click.echo(f"| one client | 1 | {tokens} | 0 | {np.median(one):.1f} | 1.00 | {alone_ttft:.1f} | {alone_itl:.1f} |")
        click.echo(f"| concurrent | {clients} | {tokens} | {failed} | {np.median(agg):.1f} | {out['scaling']:.2f} | "
                   f"{out['ttft_ms']['p50']:.1f} / {out['ttft_ms']['p99']:.1f} | "
                   f"{out['itl_ms']['p50']:.1f} / {out['itl_ms']['p99']:.1f} |")
        click.echo(f"medians of {rounds} interleaved rounds; one client {min(one):.0f} to {max(one):.0f} tok/s, "
                   f"{clients} clients {min(agg):.0f} to {max(agg):.0f}; x one client is the median of the rounds' ratios")
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
