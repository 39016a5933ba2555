"""The server's routes, a module per group, each `router(server) -> fastapi.APIRouter` over a fast.server.app.Server
(fast.server.app.ROUTES lists them)."""
