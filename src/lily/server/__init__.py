"""lily's OpenAI-compatible HTTP server (``lily serve``; docs/server.md).

    from lily.server import Server
    with Server(model, port=8000) as server:      # serves from a background thread
        ...                                       # OpenAI(base_url=server.url + "/v1", api_key="-")

Modules: ``app`` (HTTP, SSE, disconnects), ``worker`` (the queue and the one worker thread),
``schema`` (request schemas, validation, OpenAPI), ``parse`` (requests -> sampling and messages),
``prompt`` (rendering and snapshot boundaries), ``cache`` (prefix snapshots under a byte budget),
``output`` (response objects), ``cli`` (``lily serve``). The ``<think>`` split and the Qwen XML tool-call
parser are lily.reasoning and lily.toolcalls (Model.generate uses them too).
"""
from .app import Server
from .errors import APIError

__all__ = ["APIError", "Server"]
