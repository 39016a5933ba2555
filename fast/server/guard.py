"""What every HTTP request to fast.serve must pass before a route reads it (an ASGI middleware, so that nothing of a
refused request is parsed): a Host header that names this server, a JSON content type on POSTs, a bounded body that
arrives in time. Each refusal is OpenAI's error object with a 4xx status.

Why each: a browser page from anywhere may POST to a local server without a CORS preflight when the content type is
text/plain or a form's, and DNS rebinding lets a foreign page's name resolve to 127.0.0.1 (the Host header still
names the foreign site: the class of Ollama's CVE-2024-28224); a body of unbounded size, or one sent a byte a minute,
holds memory and a connection for as long as the client likes.
"""

import asyncio
import ctypes
import importlib.util
import ipaddress
import json
import socket
import time
from urllib.parse import urlsplit

MAX_BODY = 8 << 20  # bytes: a 128k-token prompt is about 0.5 MB of text, 3 MB escaped as JSON \u sequences
LARGE = 1 << 20  # bytes of input from which work takes turns and gives its memory back after (fast.serve)
BODY_SECONDS = 60.0  # for the whole body to arrive once its headers have
HEAD_SECONDS = 10.0  # for a request's headers to arrive, from the connection's start or its last response


class BodyError(Exception):
    """The body broke a limit while a route read it (the route's error handler answers with this status)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


LIBC = ctypes.CDLL(None)


def give_back_memory() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim; elsewhere nothing): glibc keeps what a
    worker thread freed, and a request that parsed megabytes would leave the server that much larger."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def host_names(host: str, allow=()) -> frozenset:
    """Names a Host header may give besides an IP address: loopback's, the served --host if it is a name, this
    machine's own names where --host binds every address, and the --host-allow entries."""
    names = {"localhost", host.lower().strip("[]"), *(a.lower() for a in allow)}
    if host in ("0.0.0.0", "::", ""):
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(names)


def host_allowed(value: str, names: frozenset) -> bool:
    """Whether a Host header (name or address, with a port or not) is this server's. An IP address is always: a
    rebinding page cannot make a browser send one for its own name."""
    try:
        host = urlsplit("//" + value).hostname
    except ValueError:
        return False
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host in names or host.endswith(".localhost") or "*" in names


def refusal(status: int, message: str, type_: str = "invalid_request_error") -> tuple[dict, bytes]:
    body = json.dumps({"error": {"code": status, "message": message, "type": type_, "param": None}}).encode()
    return {"type": "http.response.start", "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")]}, body


class Guard:
    """ASGI middleware over the application: Host, content type, body size and body deadline."""

    def __init__(self, app, names: frozenset, max_body: int = MAX_BODY, body_seconds: float = BODY_SECONDS):
        self.app, self.names, self.max_body, self.body_seconds = app, names, max_body, body_seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self.check(scope["method"], headers)
        if problem is not None:
            start, body = refusal(*problem)
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        read = self.bounded(receive)
        await self.app(scope, read, send)
        if read.got >= LARGE:  # its parsed copies are garbage now: their pages back to the system
            await asyncio.to_thread(give_back_memory)

    def check(self, method: str, headers: dict) -> tuple[int, str] | None:
        host = headers.get("host")
        if host is not None and not host_allowed(host, self.names):
            return 421, (f"Host '{host[:100]}' is not a name of this server (a DNS-rebinding page?); serve it with "
                         "--host-allow NAME")
        if method != "POST":
            return None
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            return 415, f"Content-Type must be application/json, got '{kind[:100]}'"
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_body):
            return 413, self.too_large()
        return None

    def too_large(self) -> str:
        return f"the request body is larger than this server's --max-body of {self.max_body / 2**20:g} MiB"

    def bounded(self, receive):
        """receive() raising BodyError once the body passes max_body bytes or its deadline; after the body, as it
        is (a streaming response waits on it for the client's disconnect)."""
        done, deadline = False, time.monotonic() + self.body_seconds

        async def read():
            nonlocal done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise BodyError(408, f"the request body did not arrive within {self.body_seconds:g} s") from None
            if message["type"] == "http.request":
                read.got += len(message.get("body", b""))
                if read.got > self.max_body:
                    raise BodyError(413, self.too_large())
                done = not message.get("more_body", False)
            else:
                done = True
            return message
        read.got = 0  # body bytes so far
        return read


def head_deadline(seconds: float = HEAD_SECONDS):
    """uvicorn's HTTP protocol (httptools' where installed, as uvicorn picks it, else h11's) with a deadline for each
    request's headers: a connection that has not sent a whole request head within `seconds` of opening, or of its
    last response, is closed. uvicorn times only idle keep-alive connections, and a byte resets that: a client
    sending its headers a byte a second (slowloris) held its connection for ever."""
    if importlib.util.find_spec("httptools") is not None:  # uvicorn's own test for its faster protocol
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class HeadDeadline(Base):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.start_head_timer()

        def start_head_timer(self) -> None:
            cycle = self.cycle  # a new request replaces it once its headers are in
            self.head_timer = self.loop.call_later(
                seconds, lambda: self.cycle is cycle and not self.transport.is_closing() and self.transport.close())

        def on_response_complete(self) -> None:
            self.head_timer.cancel()
            super().on_response_complete()
            self.start_head_timer()

        def connection_lost(self, exc) -> None:
            self.head_timer.cancel()
            super().connection_lost(exc)

    return HeadDeadline
