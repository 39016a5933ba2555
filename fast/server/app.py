"""The application: `Server`, what the routes share (the scheduler, the chat template, names, the API key, limits,
and the helpers every route reads a request with), and `create_app`, which puts the guard, the error handlers, the
API key and each module of `fast.server.routes` together. FastAPI is the `server` extra: imported by this module
only, which `fast.serve` imports once it has checked that it is there.

Errors are `{"error": {"code", "message", "type"}}` with a 4xx status for bad requests (a 503 with Retry-After when
the queue is full); an error during a stream is a `data: {"error": ...}` event.
"""

import asyncio
import json
import secrets
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from fast.engine import free_cores
from fast.load import load_engine, say_compiling
from fast.server.api import ApiError, parse_json
from fast.server.chat import ChatTemplate, model_template
from fast.server.guard import LARGE, MAX_BODY, BodyError, Guard, give_back_memory, host_names
from fast.server.routes import info, openai, tokens
from fast.server.scheduler import Scheduler
from ref.common.errors import UserError
from ref.common.tokenizer import load_tokenizer

SMALL = 1 << 11  # bytes of input parsed or tokenized on the event loop itself: under a millisecond
ROUTES = (info, tokens, openai)  # the modules whose router(server) the application includes


class Server:
    """What the routes share: the scheduler, the model's chat template, names, the API key and the HTTP limits."""

    def __init__(self, scheduler: Scheduler, model_path: Path, alias: str, api_key: str | None,
                 template: ChatTemplate, longest_piece: int, hosts: frozenset = host_names("127.0.0.1"),
                 max_body: int = MAX_BODY, cors: tuple[str, ...] = ()):
        self.scheduler, self.model_path, self.alias, self.api_key = scheduler, model_path, alias, api_key
        self.template, self.longest_piece = template, longest_piece
        self.hosts, self.max_body, self.cors = hosts, max_body, cors
        self.started = time.time()
        self.heavy = asyncio.Semaphore(2)  # work on inputs of LARGE bytes or more, two at a time (off_loop)

    def check_length(self, text: str, what: str) -> None:
        """Refuse a text that must tokenize to more than a slot holds, before tokenizing it: no token decodes to more
        than `longest_piece` bytes, so it is at least len(bytes) / longest_piece tokens."""
        ctx = self.scheduler.ctx
        if len(text) >= ctx and len(text.encode()) // self.longest_piece >= ctx:
            raise ApiError(400, f"the request exceeds the available context size: {what} of {len(text)} characters is "
                           f"more than {ctx} tokens (-c/--ctx-size)", param=what)

    def require_ready(self) -> None:
        """A route that needs the model: 500 where loading it failed, 503 while it loads."""
        sched = self.scheduler
        if sched.failed is not None:
            raise ApiError(500, str(load_failure(sched.failed)), "server_error")
        if not sched.ready.is_set():
            raise ApiError(503, "the model is loading", "unavailable_error")

    async def off_loop(self, size: int, fn, *args, by_size: bool = True, **kwargs):
        """fn(*args, **kwargs) in a worker thread, so that the event loop answers others meanwhile; on the loop for
        an input under SMALL bytes where the work is `by_size` (done in less time than a thread takes to start on
        it; not a chat template's, which runs the model's code). Work on inputs of a megabyte or more takes turns,
        two at a time (tokenizing 7 MB of text peaks at 600 MB), and gives its memory back to the system after
        (glibc keeps what a worker thread freed)."""
        if size < SMALL and by_size:
            return fn(*args, **kwargs)
        if size < LARGE:
            return await asyncio.to_thread(fn, *args, **kwargs)
        async with self.heavy:
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            finally:
                await asyncio.to_thread(give_back_memory)

    async def json_response(self, obj: dict, size: int) -> Response:
        """obj as a JSON response, serialized off the loop (a million token ids take a while)."""
        return Response(await self.off_loop(size, json.dumps, obj), media_type="application/json")

    async def json_body(self, request: HttpRequest) -> dict:
        """The request's body: a JSON object whose `model`, if any, is a string (any name is this server's model, as
        llama-server takes it)."""
        raw = await request.body()
        body = await self.off_loop(len(raw), parse_json, raw)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if not isinstance(body.get("model", ""), str):
            raise ApiError(400, "model must be a string", param="model")
        return body

    async def authorize(self, request: HttpRequest) -> None:
        """The API key, where one is set, on every route but the page and /health (a dependency: an HTTP middleware
        would proxy every streamed chunk through itself)."""
        if self.api_key and request.url.path not in ("/", "/health"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error")


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def api_error(_, e: ApiError):
    return error_response(e)


async def invalid(_, e: RequestValidationError):
    return error_response(ApiError(400, f"invalid request: {e.errors()[0].get('msg', e)}"))


async def http_error(_, e: HTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
    return error_response(ApiError(e.status_code, str(e.detail), kind))


async def body_error(_, e: BodyError):
    return error_response(ApiError(e.status, e.message))


def create_app(server: Server) -> FastAPI:
    """The FastAPI application over a (started) scheduler: the guard first, CORS for the listed origins, OpenAI's
    error objects for every error, the API key on every route, then each module of ROUTES."""
    app = FastAPI(title="powerinfer-py", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(server.authorize)])
    app.add_middleware(Guard, names=server.hosts, max_body=server.max_body)
    if server.cors:  # outside the guard: a preflight is answered for the listed origins only
        app.add_middleware(CORSMiddleware, allow_origins=list(server.cors), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    for error, handler in ((ApiError, api_error), (RequestValidationError, invalid), (HTTPException, http_error),
                           (BodyError, body_error)):
        app.add_exception_handler(error, handler)
    for module in ROUTES:
        app.include_router(module.router(server))
    return app


def chat_template(path: Path, tokenizer) -> ChatTemplate:
    """The model's chat template, compiled now: one that does not compile stops the server at start."""
    return ChatTemplate.of(model_template(path), tokenizer)


def serving(path: Path, slots: int, ctx_size: int, batch_size: int, max_queue: int, alias: str | None,
            api_key: str | None, host: str = "127.0.0.1", host_allow=(), max_body: int = MAX_BODY, cors=(),
            context_shift: bool = False, keep: int = 0, cache_ram: float | None = None,
            **engine_options) -> tuple[Server, FastAPI]:
    """A started scheduler, which loads the model on its engine thread (fast.load.load_engine with `engine_options`),
    and the application over it: what fast.serve and each fast.server.replicas replica run."""
    tokenizer = load_tokenizer(path)  # a bad tokenizer or chat template is refused now, not on the first request
    template = chat_template(path, tokenizer)
    longest_piece = max(len(p.encode()) for p in tokenizer.tok.get_vocab(with_added_tokens=True))
    if engine_options.get("threads") is None:  # counted now: once uvicorn starts, its own start-up looks like a
        engine_options["threads"] = free_cores()  # busy core, and a 2-core machine got 1 thread

    def load():
        engine = load_engine(path, notice=say_compiling, sequences=slots, **engine_options)
        if ctx_size > engine.config.max_seq_len:
            raise UserError(f"-c/--ctx-size {ctx_size} exceeds the model's context of {engine.config.max_seq_len}")
        return engine, tokenizer

    scheduler = Scheduler(load, slots, ctx_size or None, batch_size, max_queue, context_shift, keep, cache_ram)
    server = Server(scheduler.start(), path, alias or path.name,
                    api_key, template, longest_piece, host_names(host, host_allow), max_body, tuple(cors))
    return server, create_app(server)


def load_failure(e: BaseException) -> UserError:
    """The one line a failed load ends the server with: a UserError's own, else the exception's type and text (an
    exception's text may be empty)."""
    if isinstance(e, UserError):
        return e
    return UserError(f"loading the model failed: {type(e).__name__}" + (f": {e}" if str(e) else ""))
