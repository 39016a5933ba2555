"""The HTTP server (`python -m fast.serve`), an OpenAI-compatible API over the engine, as a package:

    app         Server (what the routes share), create_app (middleware, errors, the API key, the routes), serving
    routes/     one module per group of routes, each a router over a Server: info (/, /health, /v1/models,
                /metrics), tokens (/tokenize, /detokenize), openai (/v1/completions, /v1/chat/completions)
    api         OpenAI's request fields, checked, and its response objects
    scheduler   continuous batching over the engine's cache slots, on one engine thread
    sampling    the batched sampler (numba) the scheduler draws every step's tokens with
    guard       the ASGI middleware every request passes first (Host, body size, headers' deadline)
    chat        chat templates (Jinja2, sandboxed) and the chat page (chat.html)
    replicas    N servers behind Ray Serve (`python -m fast.server.replicas`)

More routes (llama-server's, Anthropic's) are more modules under routes/, listed in app.ROUTES.
"""
