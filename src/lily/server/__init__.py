"""lily's OpenAI-compatible HTTP server (``lily serve``; docs/server.md).

    from lily.server import Server
    with Server(model, port=8000) as server:      # serves from a background thread
        ...                                       # OpenAI(base_url=server.url + "/v1", api_key="-")

Modules: ``app`` (HTTP, SSE, disconnects), ``engine`` (the queue and the one engine thread),
``schema`` (request schemas, validation, OpenAPI), ``parse`` (requests -> sampling and messages),
``prompt`` (rendering and snapshot boundaries), ``cache`` (prefix snapshots under a byte budget),
``reasoning`` (``<think>`` split), ``toolcalls`` (Qwen XML tool calls), ``output`` (response objects),
``cli`` (``lily serve``).
"""
from .app import Server
from .errors import APIError

__all__ = ["APIError", "Server"]
