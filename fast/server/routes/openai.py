"""OpenAI's POST /v1/completions and /v1/chat/completions (and their paths without /v1), streamed as
`data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`, or whole."""

import asyncio
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fast.server.api import ApiError, Shape, check_messages, parse_params, sse
from fast.server.chat import TemplateError
from fast.server.scheduler import Params, QueueFull, Request as Job, ShuttingDown
from ref.common.errors import UserError


def router(server) -> APIRouter:
    r, sched = APIRouter(), server.scheduler

    @r.post("/v1/completions")
    @r.post("/completions")
    async def completions(request: Request):
        server.require_ready()
        body = await server.json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
        params, stream = parse_params(body, chat=False)
        server.check_length(prompt, "prompt")
        ids = await server.off_loop(len(prompt), sched.tokenizer.encode, prompt)
        return await respond(server, request, ids, params, stream, chat=False)

    @r.post("/v1/chat/completions")
    @r.post("/chat/completions")
    async def chat_completions(request: Request):
        server.require_ready()
        body = await server.json_body(request)
        messages = check_messages(body.get("messages"))
        params, stream = parse_params(body, chat=True)
        try:
            text = await server.off_loop(sum(len(m["content"]) for m in messages), server.template.render, messages,
                                         tools=body.get("tools"),
                                         add_generation_prompt=messages[-1]["role"] != "assistant", by_size=False)
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        server.check_length(text, "messages")
        ids = await server.off_loop(len(text), server.template.encode, sched.tokenizer, text)
        return await respond(server, request, ids, params, stream, chat=True)

    return r


async def respond(server, request: Request, ids: list[int], params: Params, stream: bool, chat: bool):
    """Submit the prompt ids as a job and answer with its events: a stream, or the whole completion."""
    sched, events = server.scheduler, asyncio.Queue()
    sched.loop = asyncio.get_running_loop()  # the scheduler delivers each step's events on it, in one call
    job = Job(ids, params, events.put_nowait)
    try:
        sched.submit(job)
    except QueueFull:
        raise ApiError(503, f"the server is busy: {sched.slots} slots in use and {sched.max_queue} requests "
                       "waiting; retry later", "unavailable_error") from None
    except ShuttingDown:
        raise ApiError(503, "the server is shutting down", "unavailable_error") from None
    except UserError as e:
        raise ApiError(400, str(e), param="prompt" if not chat else "messages") from None
    shape = Shape(f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}", int(time.time()), server.alias, chat,
                  sched.tokenizer)
    if stream:
        return StreamingResponse(stream_events(job, events, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    pieces = []
    gone = asyncio.create_task(disconnected(request, job, events))
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
        job.cancelled.set()  # a no-op once finished; frees the slot of a job whose handler ended early


async def disconnected(request: Request, job: Job, events: asyncio.Queue) -> None:
    """Cancel the job when its client goes away (the body is read: the next ASGI message is the disconnect), which
    the scheduler drops at its next step, and end the handler waiting on its events."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()
    events.put_nowait(("gone",))


async def stream_events(job: Job, events: asyncio.Queue, shape: Shape):
    """The job's events as server-sent events, OpenAI's chunks, then [DONE]; an error as an error event."""
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
        job.cancelled.set()
