"""POST /tokenize and /detokenize, llama-server's."""

from fastapi import APIRouter, Request

from fast.server.api import ApiError, field


def router(server) -> APIRouter:
    r, sched = APIRouter(), server.scheduler

    @r.post("/tokenize")
    async def tokenize(request: Request):
        server.require_ready()
        body = await server.json_body(request)
        content = field(body, "content", str, None, what="a string")
        if content is None:
            raise ApiError(400, "'content' is required", param="content")
        tok = sched.tokenizer
        ids = await server.off_loop(len(content), tok.encode, content)
        if not field(body, "add_special", bool, False) and tok.bos_id is not None and ids[:1] == [tok.bos_id]:
            ids = ids[1:]
        return await server.json_response({"tokens": ids}, 8 * len(ids))

    @r.post("/detokenize")
    async def detokenize(request: Request):
        server.require_ready()
        body = await server.json_body(request)
        ids, V = body.get("tokens"), sched.engine.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < V
                                                for i in ids):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {V})", param="tokens")
        tok = sched.tokenizer.tok  # decode_batch lets the event loop run meanwhile, as decode does not
        text = (await server.off_loop(8 * len(ids), tok.decode_batch, [ids], skip_special_tokens=True))[0]
        return await server.json_response({"content": text}, len(text))

    return r
