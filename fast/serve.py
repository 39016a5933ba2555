"""`python -m fast.serve [MODEL]`: an OpenAI-compatible HTTP server (llama.cpp's server's routes and flags) over the
continuous-batching scheduler (`fast.scheduler`), on FastAPI and uvicorn (the `server` extra).

Routes: POST /v1/completions, /v1/chat/completions (streamed as `data: {json}\\n\\n` events ending with
`data: [DONE]\\n\\n`, or whole), GET /v1/models, /health (503 while loading), /metrics (Prometheus text),
POST /tokenize, /detokenize, and the chat page at /. Errors are `{"error": {"code", "message", "type"}}` with a 4xx
status for bad requests (a 503 with Retry-After when the queue is full); an error during a stream is a
`data: {"error": ...}` event.
"""

from ref.common.errors import ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import click

from fast.api import ApiError, Shape, check_messages, field, parse_json, parse_params, sse
from fast.chat import ChatTemplate, TemplateError, model_template
from fast.guard import LARGE, MAX_BODY, BodyError, Guard, give_back_memory, head_deadline, host_names
from fast.scheduler import Params, QueueFull, Request, Scheduler, ShuttingDown
from ref.common.cli import (FORMAT_CHOICE, activation_sparsity_options, cache_types, kv_cache_options, resolve_model,
                            user_errors)
from ref.common.errors import UserError

PAGE = Path(__file__).with_name("chat.html")
SMALL = 1 << 11  # bytes of input parsed or tokenized on the event loop itself: under a millisecond


class Server:
    """What the routes share: the scheduler, the model's chat template, names, the API key and the HTTP limits."""

    def __init__(self, scheduler: Scheduler, model_path: Path, alias: str, api_key: str | None,
                 template: ChatTemplate, longest_piece: int, hosts: frozenset = host_names("127.0.0.1"),
                 max_body: int = MAX_BODY, cors: tuple[str, ...] = ()):
        self.scheduler, self.model_path, self.alias, self.api_key = scheduler, model_path, alias, api_key
        self.template, self.longest_piece = template, longest_piece
        self.hosts, self.max_body, self.cors = hosts, max_body, cors
        self.started = time.time()

    def check_length(self, text: str, what: str) -> None:
        """Refuse a text that must tokenize to more than a slot holds, before tokenizing it: no token decodes to more
        than `longest_piece` bytes, so it is at least len(bytes) / longest_piece tokens."""
        ctx = self.scheduler.ctx
        if len(text) >= ctx and len(text.encode()) // self.longest_piece >= ctx:
            raise ApiError(400, f"the request exceeds the available context size: {what} of {len(text)} characters is "
                           f"more than {ctx} tokens (-c/--ctx-size)", param=what)


def chat_template(path: Path, tokenizer) -> ChatTemplate:
    """The model's chat template, compiled now: one that does not compile stops the server at start."""
    return ChatTemplate.of(model_template(path), tokenizer)


def serving(path: Path, slots: int, ctx_size: int, batch_size: int, max_queue: int, alias: str | None,
            api_key: str | None, host: str = "127.0.0.1", host_allow=(), max_body: int = MAX_BODY, cors=(),
            context_shift: bool = False, keep: int = 0, cache_ram: float | None = None,
            **engine_options) -> tuple[Server, object]:
    """A started scheduler, which loads the model on its engine thread (fast.load.load_engine with `engine_options`),
    and the application over it: what fast.serve and each fast.replicas replica run."""
    from fast.engine import free_cores
    from fast.load import load_engine, say_compiling
    from ref.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)  # a bad tokenizer or chat template is refused now, not on the first request
    template = chat_template(path, tokenizer)
    longest_piece = max(len(p.encode()) for p in tokenizer.tok.get_vocab(with_added_tokens=True))
    if engine_options.get("threads") is None:  # counted now: once uvicorn starts, its own start-up looks like a
        engine_options["threads"] = free_cores()  # busy core, and a 2-core machine got 1 thread

    def load():
        engine = load_engine(path, notice=say_compiling, **engine_options)
        if ctx_size > engine.config.max_seq_len:
            raise UserError(f"-c/--ctx-size {ctx_size} exceeds the model's context of {engine.config.max_seq_len}")
        return engine, tokenizer

    scheduler = Scheduler(load, slots, ctx_size or None, batch_size, max_queue, context_shift, keep, cache_ram)
    server = Server(scheduler.start(), path, alias or path.name,
                    api_key, template, longest_piece, host_names(host, host_allow), max_body, tuple(cors))
    return server, create_app(server)


def create_app(server: Server):
    """The FastAPI application over a (started) scheduler."""
    from fastapi import Depends, FastAPI, Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="powerinfer-py", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, names=server.hosts, max_body=server.max_body)
    if server.cors:  # outside the guard: a preflight is answered for the listed origins only
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(server.cors), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    sched = server.scheduler

    def error_response(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e):
        return error_response(ApiError(400, f"invalid request: {e.errors()[0].get('msg', e)}"))

    @app.exception_handler(HTTPException)
    async def http_error(_, e):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return error_response(ApiError(e.status_code, str(e.detail), kind))

    async def authorize(request: HttpRequest):
        """The API key, where one is set, on every route but the page and /health (a dependency: an HTTP middleware
        would proxy every streamed chunk through itself)."""
        if server.api_key and request.url.path not in ("/", "/health"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error")

    app.router.dependencies.append(Depends(authorize))

    def require_ready():
        if sched.failed is not None:
            raise ApiError(500, str(load_failure(sched.failed)), "server_error")
        if not sched.ready.is_set():
            raise ApiError(503, "the model is loading", "unavailable_error")

    @app.exception_handler(BodyError)
    async def body_error(_, e: BodyError):
        return error_response(ApiError(e.status, e.message))

    heavy = asyncio.Semaphore(2)

    async def off_loop(size: int, fn, *args, by_size: bool = True, **kwargs):
        """fn(*args, **kwargs) in a worker thread, so that the event loop answers others meanwhile; on the loop for
        an input under SMALL bytes where the work is `by_size` (done in less time than a thread takes to start on
        it; not a chat template's, which runs the model's code). Work on inputs of a megabyte or more takes turns,
        two at a time (tokenizing 7 MB of text peaks at 600 MB), and gives its memory back to the system after
        (glibc keeps what a worker thread freed)."""
        if size < SMALL and by_size:
            return fn(*args, **kwargs)
        if size < LARGE:
            return await asyncio.to_thread(fn, *args, **kwargs)
        async with heavy:
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            finally:
                await asyncio.to_thread(give_back_memory)

    async def json_response(obj: dict, size: int) -> Response:
        """obj as a JSON response, serialized off the loop (a million token ids take a while)."""
        return Response(await off_loop(size, json.dumps, obj), media_type="application/json")

    async def json_body(request: HttpRequest) -> dict:
        raw = await request.body()
        body = await off_loop(len(raw), parse_json, raw)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if not isinstance(body.get("model", ""), str):  # any name is this server's model, as llama-server takes it
            raise ApiError(400, "model must be a string", param="model")
        return body

    @app.get("/health")
    async def health():
        require_ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        require_ready()
        c = sched.engine.config
        return {"object": "list", "data": [{
            "id": server.alias, "object": "model", "created": int(server.started), "owned_by": "powerinfer-py",
            "meta": {"n_vocab": c.vocab_size, "n_ctx_train": c.max_seq_len, "n_embd": c.d_model,
                     "n_params": c.n_params, "n_ctx_slot": sched.ctx, "slots": sched.slots}}]}

    @app.get("/metrics")
    async def metrics():
        m, prefix = sched.metrics, "powerinfer_py:"
        seconds = m["seconds_total"]
        lines = []
        for name, kind, value, about in [
            ("requests_total", "counter", m["requests_total"], "requests that took a slot"),
            ("requests_rejected_total", "counter", m["requests_rejected_total"], "requests refused, the queue full"),
            ("prompt_tokens_total", "counter", m["prompt_tokens_total"], "prompt tokens processed"),
            ("prompt_tokens_cached_total", "counter", m["prompt_tokens_cached_total"],
             "prompt tokens restored from the prefix cache"),
            ("prefix_cache_bytes", "gauge", sched.prefix.nbytes if sched.prefix else 0, "bytes the prefix cache holds"),
            ("prefix_cache_errors_total", "counter", m["prefix_cache_errors_total"],
             "requests whose positions could not be stored in the prefix cache"),
            ("tokens_predicted_total", "counter", m["tokens_predicted_total"], "tokens generated"),
            ("decode_steps_total", "counter", m["decode_steps_total"], "forward steps"),
            ("forward_seconds_total", "counter", seconds, "seconds spent in forward steps"),
            ("requests_processing", "gauge", sched.busy_slots(), "requests in a slot"),
            ("requests_deferred", "gauge", sched.queue_depth(), "requests waiting for a slot"),
            ("predicted_tokens_seconds", "gauge",
             m["tokens_predicted_total"] / seconds if seconds else 0.0, "generated tokens per forward second")]:
            lines += [f"# HELP {prefix}{name} {about}", f"# TYPE {prefix}{name} {kind}", f"{prefix}{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest):
        require_ready()
        body = await json_body(request)
        content = field(body, "content", str, None, what="a string")
        if content is None:
            raise ApiError(400, "'content' is required", param="content")
        ids = await off_loop(len(content), sched.tokenizer.encode, content)
        if not field(body, "add_special", bool, False) and sched.tokenizer.bos_id is not None and ids[:1] == [sched.tokenizer.bos_id]:
            ids = ids[1:]
        return await json_response({"tokens": ids}, 8 * len(ids))

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
        require_ready()
        body = await json_body(request)
        ids = body.get("tokens")
        V = sched.engine.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < V for i in ids):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {V})", param="tokens")
        tok = sched.tokenizer.tok  # decode_batch lets the event loop run meanwhile, as decode does not
        text = (await off_loop(8 * len(ids), tok.decode_batch, [ids], skip_special_tokens=True))[0]
        return await json_response({"content": text}, len(text))

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text())

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: HttpRequest):
        require_ready()
        body = await json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
        params, stream = parse_params(body, chat=False)
        server.check_length(prompt, "prompt")
        ids = await off_loop(len(prompt), sched.tokenizer.encode, prompt)
        return await respond(request, ids, params, stream, chat=False)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: HttpRequest):
        require_ready()
        body = await json_body(request)
        messages = check_messages(body.get("messages"))
        params, stream = parse_params(body, chat=True)
        try:
            text = await off_loop(sum(len(m["content"]) for m in messages), server.template.render, messages,
                                  tools=body.get("tools"), add_generation_prompt=messages[-1]["role"] != "assistant",
                                  by_size=False)
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        server.check_length(text, "messages")
        ids = await off_loop(len(text), server.template.encode, sched.tokenizer, text)
        return await respond(request, ids, params, stream, chat=True)

    async def respond(request: HttpRequest, ids: list[int], params: Params, stream: bool, chat: bool):
        events = asyncio.Queue()
        sched.loop = asyncio.get_running_loop()  # the scheduler delivers each step's events on it, in one call
        req = Request(ids, params, events.put_nowait)
        try:
            sched.submit(req)
        except QueueFull:
            raise ApiError(503, f"the server is busy: {sched.slots} slots in use and {sched.max_queue} requests "
                           "waiting; retry later", "unavailable_error") from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", "unavailable_error") from None
        except UserError as e:
            raise ApiError(400, str(e), param="prompt" if not chat else "messages") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        created = int(time.time())
        shape = Shape(rid, created, server.alias, chat, sched.tokenizer)
        if stream:
            return StreamingResponse(stream_events(req, events, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces = []
        gone = asyncio.create_task(disconnected(request, req, events))
        try:
            while True:
                ev = await events.get()
                if ev[0] == "gone":
                    return JSONResponse({}, status_code=499)  # nobody reads it
                if ev[0] == "text":
                    pieces.append(ev[1])
                elif ev[0] == "error":
                    raise ApiError(ev[2], ev[1], "server_error" if ev[2] == 500 else "unavailable_error")
                else:
                    return shape.whole("".join(pieces), ev[1], ev[2])
        finally:
            gone.cancel()
            req.cancelled.set()  # a no-op once finished; frees the slot of a request whose handler ended early

    async def disconnected(request: HttpRequest, req: Request, events: asyncio.Queue) -> None:
        """Cancel req when its client goes away (the body is read: the next ASGI message is the disconnect), which
        the scheduler drops at its next step, and end the handler waiting on its events."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        req.cancelled.set()
        events.put_nowait(("gone",))

    async def stream_events(req: Request, events: asyncio.Queue, shape: "Shape"):
        try:
            if shape.chat:
                yield sse(shape.chunk({"role": "assistant", "content": None}, None))
            while True:
                ev = await events.get()
                if ev[0] == "text":
                    yield sse(shape.chunk({"content": ev[1]} if shape.chat else ev[1], None))
                elif ev[0] == "error":
                    yield sse({"error": {"code": ev[2], "message": ev[1],
                                         "type": "server_error" if ev[2] == 500 else "unavailable_error"}})
                    break
                else:
                    yield sse(shape.chunk({} if shape.chat else "", ev[1], ev[2]))
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is closed) or the stream ended: the slot is freed
            req.cancelled.set()

    return app


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


def load_failure(e: BaseException) -> UserError:
    """The one line a failed load ends the server with: a UserError's own, else the exception's type and text (an
    exception's text may be empty)."""
    if isinstance(e, UserError):
        return e
    return UserError(f"loading the model failed: {type(e).__name__}" + (f": {e}" if str(e) else ""))


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
@click.option("--dense", is_flag=True, help="Run the dense FFN (no predictors).")
@click.option("--predictors", type=click.Path(path_type=Path), default=None,
              help="[default: MODEL_DIR/predictors.safetensors, or a PowerInfer GGUF's own]")
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
         cache_type_v, max_queue, threads, device, type_, dense, predictors, vram_budget, sparsity, sparsity_method, sparsity_file,
         alias, api_key, api_key_file, host_allow, cors, max_body, shutdown_timeout):
    """Serve MODEL_DIR (an HF folder or a GGUF file; default: the shipped model) over OpenAI's HTTP API."""
    try:
        import uvicorn
    except ImportError:
        raise UserError("fast.serve needs FastAPI and uvicorn: pip install -e '.[server]'") from None
    from ref.activation_sparsity import check_sparsity
    from ref.sparse import default_predictors

    path = resolve_model(model_dir, model)
    if sparsity is not None:
        check_sparsity(sparsity)
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
                          int(max_body * 2**20), cors, context_shift, keep, cache_ram, device=device, predictors=default_predictors(path, predictors, dense),
                          threads=threads, type_=type_, vram_budget=vram_budget, sparsity=sparsity,
                          sparsity_method=sparsity_method, sparsity_file=sparsity_file,
                          cache_types=cache_types(cache_type_k, cache_type_v))
    scheduler = server.scheduler
    click.echo(f"loading {path} on the engine thread; serving http://{host}:{port} (/health is 503 until loaded)",
               err=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=head_deadline(),
                            timeout_graceful_shutdown=shutdown_timeout + 5)  # the requests end by shutdown_timeout

    class Draining(uvicorn.Server):
        """uvicorn's server, drained on SIGINT or SIGTERM: no new connection or request; those running finish, or
        end at --shutdown-timeout with their final event; then main returns (uvicorn would raise the signal again
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
            click.echo(f"ready: {server.alias}, {slots} slots of {scheduler.ctx} positions, {e.threads} threads, "
                       f"weights {e.format.name}, FFN {'sparse' if e.selector.predicts else 'dense'}"
                       + (f", activation sparsity {sparsity:g} ({sparsity_method})" if sparsity else ""), err=True)
        await task

    try:  # on uvicorn's choice of loop (uvloop where installed: about half the CPU a streamed token costs the loop)
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(serve())
    finally:
        scheduler.stop()
    if not http.started:
        sys.exit(1)
    m = scheduler.metrics
    click.echo(f"stopped: {m['requests_total']:,} requests served, {m['tokens_predicted_total']:,} tokens predicted",
               err=True)


if __name__ == "__main__":
    main()
