"""OpenAI's API as fast.serve speaks it: request fields checked against what the engine can take (one 400 naming the
field at fault: `ApiError`), and the response and stream-chunk objects (`Shape`, llama.cpp's `timings` added)."""

import json
import math

from fast.server.scheduler import Params
from ref.common.sampling import REPEAT_LAST_N

MAX_LOGPROBS = 20
MAX_STOP = 16, 1000  # stop strings, characters each: every token checks each one's tail
INT32 = 2**31 - 1  # what the kernels' and samplers' integer fields hold
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's; what chat templates are written for


class ApiError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, message, the field at fault."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, "param": self.param}}


def field(body: dict, name: str, kind, default, check=None, what: str = ""):
    """body[name] checked to be of `kind` (and to pass `check`), else a 400 naming the field."""
    v = body.get(name, default)
    if v is None:
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool or kind is float and not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be {what or kind.__name__}, got {json.dumps(v)[:60]}", param=name)
    if check is not None and not check(v):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(v)[:60]}", param=name)
    return v


def parse_params(body: dict, chat: bool) -> tuple[Params, bool]:
    """Generation settings of a request body (OpenAI's names, llama.cpp's extras and defaults), and `stream`."""
    n = field(body, "n", int, 1, lambda v: v == 1, "1")
    if n != 1:
        raise ApiError(400, "only one completion choice is allowed ('n' must be 1)", param="n")
    for unsupported in ("best_of", "suffix"):
        if body.get(unsupported) is not None:
            raise ApiError(400, f"'{unsupported}' is not supported", param=unsupported)
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    max_tokens = field(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens", int,
                       body.get("n_predict", -1) if not isinstance(body.get("n_predict"), bool) else -1)
    if max_tokens == 0 or not -1 <= max_tokens <= INT32:
        raise ApiError(400, f"'max_tokens' must be >= 1 (or -1: until the end of text), got {max_tokens}",
                       param="max_tokens")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP[0]
                             or not all(isinstance(s, str) and len(s) <= MAX_STOP[1] for s in stop)):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP[0]} strings of at most "
                       f"{MAX_STOP[1]} characters", param="stop")
    if chat:  # logprobs: true, and top_logprobs alternatives (at least the chosen token's)
        top = field(body, "top_logprobs", int, 0, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]")
        logprobs = max(top, 1) if field(body, "logprobs", bool, False) else 0
    else:
        logprobs = field(body, "logprobs", int, 0, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]")
    seed = field(body, "seed", int, None, lambda v: abs(v) < 2**64, "an integer of at most 64 bits")
    p = Params(
        max_tokens=max_tokens,
        temperature=field(body, "temperature", float, 0.8, lambda v: 0 <= v <= 100, "a number >= 0"),
        top_k=field(body, "top_k", int, 40, lambda v: 0 <= v <= INT32, f"an integer in [0, {INT32}]"),
        top_p=field(body, "top_p", float, 0.95, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        min_p=field(body, "min_p", float, 0.05, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        repeat_penalty=field(body, "repeat_penalty", float, 1.0, lambda v: 0 < v <= 100, "a number in (0, 100]"),
        repeat_last_n=field(body, "repeat_last_n", int, REPEAT_LAST_N, lambda v: -1 <= v <= INT32,
                            f"an integer in [-1, {INT32}]"),
        presence_penalty=field(body, "presence_penalty", float, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        frequency_penalty=field(body, "frequency_penalty", float, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        seed=None if seed is None or seed < 0 else seed,
        stop=tuple(stop or ()), logprobs=logprobs, ignore_eos=field(body, "ignore_eos", bool, False),
        cache_prompt=field(body, "cache_prompt", bool, True))
    return p, field(body, "stream", bool, False)


def check_messages(messages) -> list[dict]:
    """Chat messages as the template reads them: role and text content (a string or text parts)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a 'role' of {', '.join(ROLES)}",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):  # text parts
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str) and not (content is None and m["role"] == "assistant"):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({**m, "content": content or ""})
    return out


def parse_json(raw: bytes):
    """A request body as JSON: NaN and Infinity (which Python's json takes) refused, and nesting as deep as the
    parser's recursion limit."""
    def constant(name):
        raise ValueError(f"{name} is not JSON")
    try:
        return json.loads(raw or b"null", parse_constant=constant)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Shape:
    """OpenAI's response and chunk objects for one request (llama.cpp's `timings` added)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, tokenizer):
        self.rid, self.created, self.model, self.chat, self.tok = rid, created, model, chat, tokenizer

    def head(self, kind: str) -> dict:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "powerinfer-py"}

    @staticmethod
    def usage(stats: dict) -> dict:
        return {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["completion_tokens"],
                "total_tokens": stats["prompt_tokens"] + stats["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": stats["cached_tokens"]}}

    @staticmethod
    def timings(stats: dict) -> dict:
        pn, pm, n, m = stats["prompt_tokens"], stats["prompt_ms"], stats["completion_tokens"], stats["predicted_ms"]
        pn -= stats["cached_tokens"]  # llama.cpp's prompt_n: the prompt tokens processed, cache_n those reused
        return {"cache_n": stats["cached_tokens"], "prompt_n": pn, "prompt_ms": pm, "prompt_per_second": pn / pm * 1e3 if pm else 0.0,
                "predicted_n": n, "predicted_ms": m, "predicted_per_second": n / m * 1e3 if m else 0.0,
                "queued_ms": stats["queued_ms"]}

    def logprobs(self, stats: dict):
        entries = stats["logprobs"]
        if not entries:
            return None
        piece = (lambda i: self.tok.decode([i]))
        if self.chat:
            return {"content": [{"token": piece(e["token"]), "logprob": e["logprob"],
                                 "bytes": list(piece(e["token"]).encode()),
                                 "top_logprobs": [{"token": piece(i), "logprob": lp, "bytes": list(piece(i).encode())}
                                                  for i, lp in e["top"]]} for e in entries]}
        return {"tokens": [piece(e["token"]) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{piece(i): lp for i, lp in e["top"]} for e in entries]}

    def whole(self, text: str, reason: str, stats: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": self.logprobs(stats),
                      "finish_reason": reason}
            return {**self.head("chat.completion"), "choices": [choice], "usage": self.usage(stats),
                    "timings": self.timings(stats)}
        choice = {"index": 0, "text": text, "logprobs": self.logprobs(stats), "finish_reason": reason}
        return {**self.head("text_completion"), "choices": [choice], "usage": self.usage(stats),
                "timings": self.timings(stats)}

    def chunk(self, delta, reason: str | None, stats: dict | None = None) -> dict:
        if self.chat:
            out = {**self.head("chat.completion.chunk"), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                                       "finish_reason": reason}]}
        else:
            out = {**self.head("text_completion"), "choices": [{"index": 0, "text": delta, "logprobs": None,
                                                                 "finish_reason": reason}]}
        if stats is not None:
            out["usage"], out["timings"] = self.usage(stats), self.timings(stats)
            out["choices"][0]["logprobs"] = self.logprobs(stats)
        return out
