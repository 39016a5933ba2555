"""`python -m fast.serve [MODEL]`: an OpenAI-compatible HTTP server (llama.cpp's server's routes and flags) over the
continuous-batching scheduler, on FastAPI and uvicorn (the `server` extra): the command line of the fast.server
package.

Routes: POST /v1/completions, /v1/chat/completions (streamed as `data: {json}\\n\\n` events ending with
`data: [DONE]\\n\\n`, or whole), GET /v1/models, /health (503 while loading), /metrics (Prometheus text),
POST /tokenize, /detokenize, and the chat page at /.
"""

from ref.common.errors import ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import sys
from pathlib import Path

import click

from fast.server.guard import MAX_BODY, head_deadline
from ref.common.cli import (FORMAT_CHOICE, ActivationSparsityFlags, PredictorFlags, activation_sparsity_options,
                            cache_types, kv_cache_options, predictor_options, resolve_model, user_errors)
from ref.common.errors import UserError


def read_api_key(key: str | None, file: Path | None) -> str | None:
    """--api-key (or POWERINFER_API_KEY), or the first line of --api-key-file; not both."""
    if file is None:
        if key is not None and not key.strip():
            raise UserError("--api-key is empty")
        return key
    if key is not None:
        raise UserError("--api-key-file and --api-key (or POWERINFER_API_KEY) both give a key: give one")
    try:
        lines = file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--api-key-file {file}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not lines or not lines[0].strip():
        raise UserError(f"--api-key-file {file}: its first line is empty")
    return lines[0].strip()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", required=False, type=click.Path(path_type=Path))
@click.option("-m", "--model", type=click.Path(path_type=Path), default=None, help="Same as MODEL_DIR.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("-np", "--parallel", "slots", type=int, default=4, show_default=True,
              help="Slots: requests decoded together (continuous batching).")
@click.option("-c", "--ctx-size", type=int, default=0, show_default=True,
              help="Positions each slot holds (0: the model's context); the cache grows with what the slots hold.")
@click.option("-b", "--batch-size", type=int, default=512, show_default=True, help="Most tokens in one forward step.")
@click.option("--context-shift", is_flag=True,
              help="When a slot's context fills, drop half of its tokens after --keep and go on (llama.cpp's).")
@click.option("--keep", type=int, default=0, show_default=True,
              help="Tokens of each prompt a context shift keeps (-1: all of it).")
@click.option("--cache-ram", type=float, default=None, metavar="MiB",
              help="Prefix cache: MiB of prompts' keys and values kept for requests that begin the same way (0: off) "
                   "[default: 8192, or half the memory available after loading, whichever is less].")
@kv_cache_options
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests that may wait for a slot; beyond them the server answers 503 with Retry-After.")
@click.option("-t", "--threads", type=int, default=None, help="CPU threads [default: the idle cores].")
@click.option("--device", type=click.Choice(["cpu", "gpu", "hybrid"]), default="cpu", show_default=True,
              help="cpu; gpu: every layer on the GPU; hybrid: PowerInfer's split of hot and cold neurons (needs CUDA).")
@click.option("--type", "type_", type=FORMAT_CHOICE, default=None, help="Weight format to run in [default: as stored].")
@predictor_options
@click.option("--vram-budget", type=float, default=None, help="GiB of GPU memory (gpu/hybrid).")
@activation_sparsity_options
@click.option("-a", "--alias", default=None, help="The model's name in the API [default: the model's file or folder name].")
@click.option("--api-key", default=None, envvar="POWERINFER_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every route but / and /health.")
@click.option("--api-key-file", type=click.Path(path_type=Path), default=None,
              help="Read --api-key from this file's first line (kept out of the process list).")
@click.option("--host-allow", multiple=True, metavar="NAME",
              help="Another name clients reach this server by (Host header); IP addresses and localhost always "
                   "pass; '*' passes any (repeatable).")
@click.option("--cors", multiple=True, metavar="ORIGIN",
              help="Let pages of this origin (https://example.com) call the API from a browser (repeatable).")
@click.option("--max-body", type=float, default=MAX_BODY / 2**20, show_default=True,
              help="Largest request body in MiB; larger ones get 413 before they are read.")
@click.option("--shutdown-timeout", type=float, default=10.0, show_default=True,
              help="On SIGINT or SIGTERM, seconds running requests may go on before they end with their final event.")
@user_errors
def main(model_dir, model, host, port, slots, ctx_size, batch_size, context_shift, keep, cache_ram, cache_type_k,
         cache_type_v, max_queue, threads, device, type_, pred: PredictorFlags, vram_budget, act: ActivationSparsityFlags,
         alias, api_key, api_key_file, host_allow, cors, max_body, shutdown_timeout):
    """Serve MODEL_DIR (an HF folder or a GGUF file; default: the shipped model) over OpenAI's HTTP API."""
    if not all(importlib.util.find_spec(name) for name in ("fastapi", "uvicorn", "jinja2")):
        raise UserError("fast.serve needs FastAPI and uvicorn: pip install -e '.[server]'")
    from fast.server.app import serving

    path = resolve_model(model_dir, model)
    pred.check(), act.check()
    api_key = read_api_key(api_key, api_key_file)
    if not max_body > 0:
        raise UserError(f"--max-body must be > 0 MiB, got {max_body:g}")
    if not 0 <= shutdown_timeout <= 3600:
        raise UserError(f"--shutdown-timeout must be in [0, 3600] seconds, got {shutdown_timeout:g}")
    if ctx_size < 0:
        raise UserError(f"-c/--ctx-size must be >= 0, got {ctx_size}")
    if not 0 < port < 65536:
        raise UserError(f"--port must be in [1, 65535], got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:  # as uvicorn will bind it
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    server, app = serving(path, slots, ctx_size, batch_size, max_queue, alias, api_key, host, host_allow,
                          int(max_body * 2**20), cors, context_shift, keep, cache_ram, device=device,
                          threads=threads, type_=type_, vram_budget=vram_budget,
                          cache_types=cache_types(cache_type_k, cache_type_v), **pred.options(path), **act.options())
    click.echo(f"loading {path} on the engine thread; serving http://{host}:{port} (/health is 503 until loaded)",
               err=True)
    if not serve_until_stopped(server, app, host, port, shutdown_timeout, act.about()):
        sys.exit(1)
    m = server.scheduler.metrics
    click.echo(f"stopped: {m['requests_total']:,} requests served, {m['tokens_predicted_total']:,} tokens predicted",
               err=True)


def serve_until_stopped(server, app, host: str, port: int, shutdown_timeout: float, about: str) -> bool:
    """Run uvicorn over the app until SIGINT or SIGTERM (drained: no new connection or request; those running finish,
    or end at --shutdown-timeout with their final event) or a failed load (its one line raised); say when the model
    is ready. -> whether uvicorn started."""
    import uvicorn

    from fast.server.app import load_failure

    scheduler = server.scheduler
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=head_deadline(),
                            timeout_graceful_shutdown=shutdown_timeout + 5)  # the requests end by shutdown_timeout

    class Draining(uvicorn.Server):
        """uvicorn's server, drained on SIGINT or SIGTERM; then serve returns (uvicorn would raise the signal again
        once done: a traceback for SIGINT, death by SIGTERM). A second Ctrl-C quits at once."""

        async def shutdown(self, sockets=None):
            scheduler.drain(shutdown_timeout)
            await super().shutdown(sockets)

        def handle_exit(self, sig, frame):
            if sig == signal.SIGINT and self.should_exit:  # whatever the loop or a worker thread is doing
                os.write(2, b"\ninterrupted again: quitting now\n")
                os._exit(130)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            handlers = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    http = Draining(config)

    async def serve():
        task = asyncio.create_task(http.serve())
        while not scheduler.ready.is_set() and scheduler.failed is None and not task.done():
            await asyncio.sleep(0.1)
        if scheduler.failed is not None:
            http.should_exit = True
            await task
            raise load_failure(scheduler.failed)
        if scheduler.ready.is_set():
            e = scheduler.engine
            click.echo(f"ready: {server.alias}, {scheduler.slots} slots of {scheduler.ctx} positions, {e.threads} "
                       f"threads, weights {e.format.name}, FFN {'sparse' if e.selector.predicts else 'dense'}{about}",
                       err=True)
        await task

    try:  # on uvicorn's choice of loop (uvloop where installed: about half the CPU a streamed token costs the loop)
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(serve())
    finally:
        scheduler.stop()
    return http.started


if __name__ == "__main__":
    main()
