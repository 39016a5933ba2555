"""GET /, /health (503 while loading), /v1/models (and /models), /metrics (Prometheus text)."""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, PlainTextResponse

PAGE = Path(__file__).parents[1] / "chat.html"


def router(server) -> APIRouter:
    r, sched = APIRouter(), server.scheduler

    @r.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text())

    @r.get("/health")
    async def health():
        server.require_ready()
        return {"status": "ok"}

    @r.get("/v1/models")
    @r.get("/models")
    async def models():
        server.require_ready()
        c = sched.engine.config
        return {"object": "list", "data": [{
            "id": server.alias, "object": "model", "created": int(server.started), "owned_by": "powerinfer-py",
            "meta": {"n_vocab": c.vocab_size, "n_ctx_train": c.max_seq_len, "n_embd": c.d_model,
                     "n_params": c.n_params, "n_ctx_slot": sched.ctx, "slots": sched.slots}}]}

    @r.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(sched), media_type="text/plain; version=0.0.4")

    return r


def prometheus(sched) -> str:
    """The scheduler's counters and gauges in Prometheus's text format, llama-server's names under powerinfer_py:."""
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
    return "\n".join(lines) + "\n"
