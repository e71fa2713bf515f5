"""The HTTP layer: uvicorn (httptools) and Starlette in front of one ``Worker``.

``Server`` binds its socket at once and serves from one asyncio event loop (uvloop's; uvicorn, with
httptools' strict HTTP/1.1 parser, llhttp) in a background thread. A request's body is read within
a deadline; its JSON is validated and its prompt tokenized (on the event loop for a small request
without images or structured output, where the hop to a thread and back would cost more than the
work; in a worker thread otherwise), and the job is submitted to the engine's FIFO queue. The
response relays the job's events: as one JSON object, or as ``text/event-stream`` chunks ending in
``data: [DONE]``; a stream's headers wait (briefly) for an idle worker to reach the engine, whose
pass then runs without the GIL while they are written. The worker thread wakes the
event loop after each item (``Job.notify``). While a response waits, a task listens for the
client's disconnect (uvicorn's ``http.disconnect``); when it comes, the job is cancelled, which
frees the engine at the next token.

``_Protocol`` adds to uvicorn's httptools protocol what uvicorn lacks: a cap on open connections
(refused at accept with a JSON 503), a deadline for a request's line, headers and body from its
first byte, a keep-alive timeout from the moment a connection opens, a size limit on a request's
line and headers, the checks h11 made that llhttp does not (exactly one ``Host`` on HTTP/1.1; HTTP/1.0
or 1.1 only), half-close support (an end of stream after a complete request is not a disconnect),
JSON 400s for malformed HTTP (a pipelined request's after the answers before it), and request lines
logged with control characters escaped.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import httptools
import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..errors import LilyError
from ..multimodal import URLPolicy, expand_image_pads, extract_images, has_image_parts
from .worker import DEFAULT_CACHE_MIB, DEFAULT_MAX_QUEUE, Job, QueueFull, ShuttingDown, Source, Worker
from .errors import APIError, bad_request
from .output import ChatOutput, CompletionLogprobs, chat_logprob, usage
from .parse import Request, content_text, parse_chat, parse_completion
from .prompt import DEFAULT_SEGMENT_CACHE_MIB, Prompt, PromptTooLong, SegmentEncoder, chat_prompt, text_prompt
from .schema import openapi

MAX_BODY_BYTES = 32 << 20
INLINE_BODY_BYTES = 4096  # a request body up to this size may be prepared on the event loop (_inline)
POLL_SECONDS = 0.1  # how often a half-closed client's non-streamed answer is probed (see _relay)
START_WAIT_SECONDS = 0.01  # the longest a stream's headers wait for an idle worker to reach the engine
RETRY_AFTER_SECONDS = 1
MAX_CHARS_PER_TOKEN = 32  # default prompt-character limit per token of context (max_prompt_chars)
# Limits of the HTTP layer (docs/server.md lists them all with their defaults).
MAX_CONNECTIONS = 256       # open connections at once; more are answered 503 and closed at once
REQUEST_TIMEOUT = 30.0      # seconds to receive a request's line, headers and body, from its first byte
KEEPALIVE_TIMEOUT = 15.0    # seconds an idle connection (new, or between requests) waits for a request
WRITE_TIMEOUT = 60.0        # seconds one write to a client that does not read may block
SHUTDOWN_GRACE = 10.0       # seconds close() waits for running responses to end
MAX_HEAD_BYTES = 64 << 10   # request line + headers (counted by _Protocol)
CONNECTION = "lily.connection"  # the scope key of the request's _Protocol

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with control characters escaped, safe to write to a log or a terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _error_bytes(status: int, message: str, code: str) -> bytes:
    return _dumps(APIError(status, message, code=code).body())


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with lily's connection limits (see the module docstring). ``lily``
    is set on the per-server subclass that ``Server`` makes."""

    lily: "Server"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.eof = False              # the client shut its write side after a complete request
        self.deadline: float | None = None  # loop time by which the current request must have arrived
        self._timer: asyncio.TimerHandle | None = None
        self._idle = True             # no request bytes since the last response (or since the start)
        self._awaiting_head = False   # the current request has begun but its line and headers are not complete
        self._head = b""              # the first bytes of the current request, for the log
        self._in_head = False         # the parser is inside a head (the current request's or a pipelined one's)
        self._head_bytes = 0          # the bytes of that head so far (see data_received)
        self._heads_begun = 0         # requests begun in the read being parsed
        self._invalid: str | None = None  # a parse error found while an earlier response runs: answered after it

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        limit = self.lily.max_connections
        if len(self.connections) > limit:
            body = _error_bytes(503, f"too many open connections (the limit is {limit}); retry later",
                                "too_many_connections")
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Connection: close\r\nRetry-After: %d\r\nContent-Length: %d\r\n\r\n%s"
                            % (RETRY_AFTER_SECONDS, len(body), body))
            transport.close()
            return
        # uvicorn arms its keep-alive timer only after a response; a connection that never sends a
        # byte is closed after the same time.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._invalid is not None:
            return  # the parser has failed; its 400 waits for the running response
        started = self._idle  # the first bytes of a request: its deadline starts now
        if started:
            self._idle = False
            self._awaiting_head = True
            self._head = data[:200]
            self.deadline = self.loop.time() + self.lily.request_timeout
            self._cancel_timer()
            self._timer = self.loop.call_at(self.deadline, self._request_timeout)
        self._unset_keepalive_if_required()
        self._heads_begun = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # no WebSockets here (ws="none"): answered as plain HTTP
            return
        except httptools.HttpParserError as e:  # an error raised in a callback (the Host check) is the context
            cause = e.__context__ if isinstance(e, httptools.HttpParserCallbackError) else None
            self._refuse(str(cause or e))
            return
        if self._in_head:  # the head limit: what an incomplete head has received so far
            if self._heads_begun == 0:  # it began in an earlier read
                self._head_bytes += len(data)
            elif started and self._heads_begun == 1:  # it began with this read
                self._head_bytes = len(data)
            # else a pipelined head began inside this read: it is counted from the next read on
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def _refuse(self, reason: str) -> None:
        """A 400 for what the parser refused: at once, or, when the error is in a later (pipelined)
        request, after the answers to the requests before it."""
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            self._invalid = reason
            self.flow.pause_reading()
        else:
            self.send_400_response(reason)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        self._heads_begun += 1
        self.scope[CONNECTION] = self  # read by the app

    def on_headers_complete(self) -> None:
        self._in_head = self._awaiting_head = False
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            raise httptools.HttpParserError(f"HTTP/{version} is not supported")
        hosts = sum(name == b"host" for name, _ in self.headers)
        if version == "1.1" and hosts != 1:  # RFC 9112: exactly one
            raise httptools.HttpParserError("Missing mandatory Host: header" if not hosts
                                            else "Found multiple Host: headers")
        body = any(name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0"))
                   for name, value in self.headers)
        if body and self.parser.should_upgrade():
            # httptools skips the body of an upgrade request (h2c from curl --http2, say): refused, not misread
            raise httptools.HttpParserError("a request that asks for a protocol upgrade (Connection: upgrade) "
                                            "cannot have a body here; send it without the upgrade")
        super().on_headers_complete()

    def _request_timeout(self) -> None:
        self._timer = None
        if self._awaiting_head and not self.transport.is_closing():
            # The line and headers did not arrive in time (a slow body is answered 408 by the app).
            self.transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_response_complete(self) -> None:
        self._cancel_timer()
        self._idle = True
        if self.eof and not self.transport.is_closing():
            self.transport.close()  # a half-closed client sends nothing more
            return
        pipelined = bool(self.pipeline)
        super().on_response_complete()  # starts a pipelined request, if one is waiting
        if pipelined:  # buffered during the previous response: its deadline starts now
            self._idle = False
            self.deadline = self.loop.time() + self.lily.request_timeout
        elif self._invalid is not None and not self.transport.is_closing():
            self.send_400_response(self._invalid)

    def eof_received(self):
        """The client shut its write side. Between requests (or mid-headers) that ends the connection;
        after a request's headers, it may be a half-close of a client still waiting for the answer:
        keep the write side open (a real disconnect shows when a write fails)."""
        if self.cycle is None or self._awaiting_head or self.cycle.response_complete:
            return None  # the transport closes
        self.eof = True
        self.cycle.message_event.set()  # a body still being read ends short (the app answers 400)
        return True

    def send_400_response(self, msg: str) -> None:
        """A request the parser refuses (malformed line or headers, ambiguous framing, no Host, a head
        over the limit): a JSON 400, the connection closed."""
        reason = printable(msg)[:200]
        if self.lily.log:
            client = "%s:%d" % self.client if self.client else "-"
            line = self._head.split(b"\r\n", 1)[0][:160].decode("latin-1")
            self.lily.write_log(f'{client} "{printable(line)}" 400 (invalid HTTP request: {reason})')
        body = _error_bytes(400, f"invalid HTTP request: {reason}", "invalid_http_request")
        try:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        finally:
            self.transport.close()


class Server:
    """An OpenAI-compatible server for one loaded ``lily.Model``.

    ``port=0`` picks a free port (see ``url``). ``api_key``: when set, /v1/* needs
    ``Authorization: Bearer KEY``. ``model_name``: the id clients send and /v1/models lists;
    ``aliases`` are accepted too. ``max_queue``: requests that may wait while one runs.
    ``cache_mib``: the prefix-snapshot budget. ``token_cache_mib``: the budget for the token ids of
    rendered message pieces (prompt.SegmentEncoder; 0 keeps none). ``source``: a test hook that replaces the model's
    generation (see worker.Source).
    """

    def __init__(self, model, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 model_name: str | None = None, aliases: tuple[str, ...] = (), max_queue: int = DEFAULT_MAX_QUEUE,
                 cache_mib: int = DEFAULT_CACHE_MIB, max_context: int | None = None, source: Source | None = None,
                 log: bool = False, max_body_bytes: int = MAX_BODY_BYTES, max_connections: int = MAX_CONNECTIONS,
                 request_timeout: float = REQUEST_TIMEOUT, keepalive_timeout: float = KEEPALIVE_TIMEOUT,
                 write_timeout: float = WRITE_TIMEOUT, max_prompt_chars: int | None = None,
                 allow_control_tokens: bool = False, token_cache_mib: int = DEFAULT_SEGMENT_CACHE_MIB,
                 image_policy: URLPolicy | None = None, image_pixels: tuple[int | None, int | None] = (None, None)):
        self.model = model
        # Which image URLs requests may use: data: only, unless the operator allows more.
        self.image_policy = image_policy or URLPolicy()
        # The operator's image resize bounds (None: the checkpoint's); a request's mm_processor_kwargs win.
        self.image_pixels = image_pixels
        self.tokenizer = model.tokenizer  # loaded once here, shared by the worker threads
        if token_cache_mib < 0:
            raise LilyError(f"token_cache_mib must be >= 0, got {token_cache_mib}")
        self.encoder = SegmentEncoder(self.tokenizer, int(token_cache_mib) << 20)
        self.defaults = model.default_sampling()
        self.model_name = model_name or Path(model.path).name
        self.names = {self.model_name, *aliases}
        if api_key is not None and not api_key.strip():
            raise LilyError("the API key is empty: give a non-empty key, or none to serve without one")
        self.api_key = api_key or None
        self.log = log
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self.request_timeout, self.keepalive_timeout = request_timeout, keepalive_timeout
        self.write_timeout = write_timeout
        # Text of the tokenizer's special tokens (<|im_start|>, <|im_end|>, ...): in message text they
        # would encode as the control tokens themselves and forge turns, so they are refused.
        specials = sorted({t for t in (self.tokenizer.id_to_token(i) for i in self.tokenizer.special_ids) if t},
                          key=len, reverse=True)
        self.control_tokens = None if allow_control_tokens or not specials else \
            re.compile("|".join(map(re.escape, specials)))
        self.created = int(time.time())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(2048)
        except OSError:
            self._sock.close()
            raise
        try:
            self.worker = Worker(model, max_queue=max_queue, cache_bytes=int(cache_mib) << 20,
                                 max_context=max_context, source=source)
            if log:  # cancelled requests get a line of their own: id, tokens so far, reason
                self.worker.log = self.write_log
        except BaseException:
            self._sock.close()
            raise
        # Prompt text longer than this cannot fit the context (no token spans more characters): it is
        # refused before tokenizing. Default: MAX_CHARS_PER_TOKEN characters per token of context.
        self.max_prompt_chars = max_prompt_chars or self.worker.max_context * MAX_CHARS_PER_TOKEN
        protocol = type("_ServerProtocol", (_Protocol,), {"lily": self})
        self.config = uvicorn.Config(
            _App(self, _routes(self)), http=protocol, ws="none", lifespan="off", interface="asgi3", log_config=None,
            log_level="error", access_log=False, proxy_headers=False, server_header=False,
            timeout_keep_alive=keepalive_timeout,
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE),
            headers=[("server", "lily")])
        self._uvicorn = uvicorn.Server(self.config)
        self._thread: threading.Thread | None = None
        # Set when the serving thread has ended. Waited on instead of Thread.join: a join interrupted
        # by KeyboardInterrupt (SIGTERM in `lily serve`) marks the thread stopped on Python 3.11
        # while it still runs, and a later join would return at once, cutting open streams.
        self._stopped = threading.Event()
        self._log_lock = threading.Lock()

    @property
    def host(self) -> str:
        return self._sock.getsockname()[0]

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._uvicorn.server_state.connections)

    def serve_forever(self) -> None:
        """Serve until the server stops (close() from another thread) or KeyboardInterrupt."""
        if self._thread is None:
            self.start()
        while self._thread is not None and not self._stopped.wait(0.5):
            pass

    def start(self) -> "Server":
        """Serve from a background thread (returns once the server accepts connections)."""
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="lily-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started and not self._stopped.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        return self

    def _run(self) -> None:
        try:
            uvloop.run(self._uvicorn.serve(sockets=[self._sock]))
        finally:
            self._stopped.set()

    def close(self) -> None:
        """Stop accepting connections, cancel what is queued or running (open streams end with the
        error event and [DONE]), wait up to SHUTDOWN_GRACE s for the responses, free the socket."""
        if self._thread is not None:
            self._uvicorn.should_exit = True  # stops accepting at its next tick (0.1 s)
            self.worker.close()  # running and queued jobs end as cancelled: their responses end
            self._stopped.wait(SHUTDOWN_GRACE + 5)
            self._thread = None
        else:
            self.worker.close()
        self._sock.close()
        # The app and the protocol class refer back to this server: a cycle. Drop the snapshots now
        # rather than at some later garbage collection (or never, at exit: nanobind reports leaks).
        self.worker.cache.clear()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def write_log(self, line: str) -> None:
        with self._log_lock:
            sys.stderr.write(f"lily serve: {line}\n")
            sys.stderr.flush()

    def model_object(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lily",
                "max_model_len": self.worker.max_context}

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def check_control_tokens(self, messages: list[dict]) -> None:
        """Refuse message text that spells a special token (a forged turn), unless allowed."""
        if self.control_tokens is None:
            return
        for i, m in enumerate(messages):
            for field in ("content", "reasoning_content"):
                found = self.control_tokens.search(content_text(m.get(field)))
                if found:
                    name = "content" if field == "content" else "reasoning_content"
                    raise bad_request(f"'messages[{i}].{name}' contains the control token {found.group()!r}; "
                                      f"special tokens are not allowed in message text (the server's "
                                      f"--allow-control-tokens turns this check off)", f"messages[{i}].{name}",
                                      "control_token")

    def check_chars(self, n: int, field: str) -> None:
        """Refuse prompt text over max_prompt_chars before any template or tokenizer runs."""
        if n > self.max_prompt_chars:
            raise bad_request(f"the prompt has {n} characters; this server takes at most {self.max_prompt_chars} "
                              f"(a context of {self.worker.max_context} tokens)", field, "context_length_exceeded")

    def too_long(self, tokens: int, field: str) -> APIError:
        return bad_request(f"the prompt has more than {tokens} tokens, but the context holds "
                           f"{self.worker.max_context}", field, "context_length_exceeded")

    def fit_context(self, prompt: Prompt, req: Request, prompt_field: str):
        """The request's SamplingParams with max_tokens fitted to the context; 400 when it cannot fit."""
        n, room = len(prompt.ids), self.worker.max_context
        if n == 0:
            raise bad_request("the prompt is empty (no tokens)", prompt_field)
        if n >= room:
            raise bad_request(f"the prompt has {n} tokens, but the context holds {room} (at least one token "
                              f"must be left to generate)", prompt_field, "context_length_exceeded")
        params = req.params
        if req.max_tokens_field is not None and n + params.max_tokens > room:
            raise bad_request(f"{req.max_tokens_field}={params.max_tokens} with a {n}-token prompt exceeds the "
                              f"context of {room} tokens; at most {room - n} tokens can be generated",
                              req.max_tokens_field, "context_length_exceeded")
        if req.max_tokens_field is None and params.max_tokens is not None and n + params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room - n)
        return params




# --- the ASGI application ----------------------------------------------------------------------------

DISCONNECTED = "the client disconnected"


class _Gone(Exception):
    """The client disconnected."""


class _App:
    """The outermost ASGI layer: path normalisation, the API key on /v1/*, the request log; then the
    Starlette routes."""

    def __init__(self, server: Server, routes: Starlette):
        self.server, self.routes = server, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        server = self.server
        path = scope["path"].rstrip("/") or "/"
        scope = dict(scope, path=path)
        status = []

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            if path.startswith("/v1/") and not _authorized(server.api_key, scope):
                header = _header(scope, b"authorization")
                what = "missing" if not header else "incorrect"
                await _error_response(APIError(401, f"{what} API key: send 'Authorization: Bearer KEY' with the "
                                                    f"server's key", code="invalid_api_key"))(scope, receive, logged_send)
            else:
                await self.routes(scope, receive, logged_send)
        finally:
            if server.log:
                client = "%s:%d" % tuple(scope["client"]) if scope.get("client") else "-"
                target = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope["query_string"] else "")
                server.write_log(f'{client} "{printable(scope["method"])} {printable(target)} '
                                 f'HTTP/{scope["http_version"]}" {status[0] if status else "-"}')


def _header(scope, name: bytes) -> str:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return ""


def _authorized(key: str | None, scope) -> bool:
    if key is None:
        return True
    scheme, _, given = _header(scope, b"authorization").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _json_response(status: int, obj, headers: dict | None = None) -> Response:
    return Response(_dumps(obj), status, headers=headers, media_type="application/json")


def _error_response(e: APIError) -> Response:
    return _json_response(e.status, e.body(), e.headers)


def _routes(server: Server) -> Starlette:
    s = server

    async def health(request):
        return _json_response(200, {"status": "ok", "model": s.model_name, **s.worker.stats(),
                                    "token_cache": s.encoder.stats()})

    async def models(request):
        return _json_response(200, {"object": "list", "data": [s.model_object()]})

    async def model(request):
        s.check_model(request.path_params["name"])
        return _json_response(200, s.model_object())

    async def openapi_doc(request):
        from .._version import __version__

        return _json_response(200, openapi(__version__))

    async def metrics(request):  # Prometheus text: requests, tokens, queue, TTFT and tok/s (server/metrics.py)
        return Response(s.worker.metrics.render(s.worker), 200, media_type="text/plain; version=0.0.4")

    async def version(request):
        from .._version import __version__

        return _json_response(200, {"version": __version__, "model": s.model_name})

    async def chat(request):
        return await _completion_endpoint(s, request, _prepare_chat)

    async def completions(request):
        return await _completion_endpoint(s, request, _prepare_completion)

    async def api_error(request, e: APIError):
        return _error_response(e)

    async def http_error(request, e: HTTPException):
        if e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            return _error_response(APIError(405, f"{request.url.path} takes {allowed}, not {request.method}",
                                            code="method_not_allowed", headers={"Allow": allowed}))
        if e.status_code == 404:
            return _error_response(APIError(404, f"no such route: {printable(request.method)} "
                                                 f"{printable(request.url.path)} (see GET /openapi.json)",
                                            code="not_found"))
        return _error_response(APIError(e.status_code, printable(str(e.detail)), code="http_error"))

    async def internal_error(request, e: Exception):  # a bug: the traceback goes to stderr (uvicorn's log)
        return _error_response(APIError(500, f"internal server error: {type(e).__name__}: {e}",
                                        code="internal_error"))

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi_doc, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ], exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error})
    app.router.redirect_slashes = False
    return app


async def _read_body(s: Server, request: HTTPRequest) -> bytes:
    """The request body, within the request deadline and the size limit; Content-Length framing only
    (the parser has already refused conflicting or malformed lengths)."""
    scope = request.scope
    close = {"Connection": "close"}
    if _header(scope, b"transfer-encoding"):
        raise APIError(411, "chunked request bodies are not supported; send Content-Length", code="length_required",
                       headers=close)
    length = _header(scope, b"content-length")
    if not length:
        return b""
    n = int(length)
    if n > s.max_body_bytes:
        raise APIError(413, f"the request body has {n} bytes; the limit is {s.max_body_bytes}",
                       code="request_too_large", headers=close)
    conn = scope.get(CONNECTION)
    loop = asyncio.get_running_loop()
    deadline = conn.deadline if conn is not None and conn.deadline is not None else loop.time() + s.request_timeout
    parts, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), max(deadline - loop.time(), 0.01))
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {s.request_timeout:g} s",
                           code="request_timeout", headers=close) from None
        if message["type"] == "http.disconnect":
            raise _Gone(DISCONNECTED)
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if not message.get("more_body", False):
            return b"".join(parts)
        if conn is not None and conn.eof:
            raise bad_request(f"the request body ended after {size} of {n} bytes", code="incomplete_body")


def _json(raw: bytes) -> dict:
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not UTF-8 ({e})", code="invalid_json") from None
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}",
                          code="invalid_json")
    return body


# --- completions ---------------------------------------------------------------------------------------

def _submit(s: Server, prefix: str, prompt: Prompt, params, notify, constraint=None) -> Job:
    job = Job(prefix + uuid.uuid4().hex, prompt, params, constraint)
    job.notify = notify
    try:
        s.worker.submit(job)
    except QueueFull as e:
        raise APIError(429, f"the server is busy: {e}; retry after {RETRY_AFTER_SECONDS} s",
                       code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except ShuttingDown as e:
        raise APIError(503, str(e), code="shutting_down") from None
    return job


class _ChatRenderer:
    """Chat completion objects from a job's events (streamed chunks, or one response at the end)."""

    def __init__(self, s: Server, req: Request, prompt: Prompt, params, job: Job):
        self.s, self.req, self.job = s, req, job
        self.stream = req.stream
        self.out = ChatOutput(prompt.thinking, req.tool_defs if req.parse_tools else None)
        self.want_logprobs = params.num_logprobs >= 0
        self.logprobs: list = []
        self.head = {"id": job.id, "created": int(time.time()), "model": s.model_name}
        self.chunk = {**self.head, "object": "chat.completion.chunk", "system_fingerprint": None}
        if req.include_usage:
            self.chunk["usage"] = None

    def _send(self, delta: dict, logprobs=None, finish=None) -> dict:
        return {**self.chunk, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def start(self) -> list[dict]:
        return [self._send({"role": "assistant", "content": ""})]

    def event(self, payload) -> list[dict]:
        lp = None
        if self.want_logprobs and payload.logprobs is not None:
            lp = chat_logprob(self.s.tokenizer, payload.logprobs)
        delta = self.out.feed(payload)
        if not self.stream:
            if lp is not None:
                self.logprobs.append(lp)
            return []
        lp = {"content": [lp]} if lp is not None else None
        return [self._send(delta, lp)] if delta or lp else []

    def done(self, result):
        """The stream's last chunks, or the whole response."""
        delta = self.out.finish()
        if not self.stream:
            choice = {"index": 0, "message": self.out.message(),
                      "logprobs": {"content": self.logprobs} if self.want_logprobs else None,
                      "finish_reason": self.out.finish_reason(result)}
            return {**self.head, "object": "chat.completion", "choices": [choice], "usage": usage(result),
                    "system_fingerprint": None}
        chunks = [self._send(delta)] if delta else []
        chunks.append(self._send({}, finish=self.out.finish_reason(result)))
        if self.req.include_usage:
            chunks.append({**self.chunk, "choices": [], "usage": usage(result)})
        return chunks


class _CompletionRenderer:
    """Text completion objects from a job's events."""

    def __init__(self, s: Server, req: Request, params, job: Job):
        self.req, self.stream = req, req.stream
        self.n = params.num_logprobs
        self.lps = CompletionLogprobs(s.tokenizer, self.n > 0) if self.n >= 0 else None
        self.head = {"id": job.id, "object": "text_completion", "created": int(time.time()), "model": s.model_name,
                     "system_fingerprint": None}
        if self.stream and req.include_usage:
            self.head["usage"] = None
        self.texts: list[str] = []
        self.entries: list = []

    def start(self) -> list[dict]:
        return []

    def event(self, payload) -> list[dict]:
        lp = self.lps.entry(payload.logprobs) if self.lps is not None and payload.logprobs is not None else None
        if not self.stream:
            self.texts.append(payload.text)
            if lp is not None:
                self.entries.append(lp)
            return []
        if payload.text or lp or payload.finish_reason:
            return [{**self.head, "choices": [{"index": 0, "text": payload.text, "logprobs": lp,
                                               "finish_reason": None}]}]
        return []

    def done(self, result):
        if not self.stream:
            choice = {"index": 0, "text": "".join(self.texts),
                      "logprobs": CompletionLogprobs.merge(self.entries, self.n > 0) if self.lps is not None else None,
                      "finish_reason": result.finish_reason}
            return {**self.head, "choices": [choice], "usage": usage(result)}
        chunks = [{**self.head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                             "finish_reason": result.finish_reason}]}]
        if self.req.include_usage:
            chunks.append({**self.head, "choices": [], "usage": usage(result)})
        return chunks


def _inline(body: dict) -> bool:
    """Whether a small request (at most INLINE_BODY_BYTES) is prepared on the event loop: not when it
    has structured output (a grammar to compile) or a message content of parts (images to decode or
    fetch); its template render and tokenizing take well under a millisecond."""
    if "response_format" in body or "tool_choice" in body:
        return False
    messages = body.get("messages", [])
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), (str, type(None))) for m in messages)


def _prepare_chat(s: Server, body: dict, notify):
    """Validate, render and tokenize a chat request and submit its job (see _completion_endpoint for
    the thread it runs in)."""
    req = parse_chat(body, s.defaults)
    s.check_model(req.model)
    s.check_chars(sum(len(content_text(m.get("content"))) + len(m.get("reasoning_content") or "")
                      for m in req.messages), "messages")
    s.check_control_tokens(req.messages)
    messages, images = _read_images(s, req.messages, req.image_pixels)
    try:
        prompt = chat_prompt(s.tokenizer, messages, req.tools, req.template_kwargs, s.worker.max_context,
                             s.encoder)
        if images:
            ids, cuts = expand_image_pads(prompt.ids, images, s.model.config.image_token_id, prompt.boundaries)
            prompt = Prompt(ids, tuple(cuts), prompt.thinking, tuple(images))
    except PromptTooLong as e:
        raise s.too_long(e.tokens, "messages") from None
    except LilyError as e:
        raise bad_request(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 - the template failed on these messages
        raise bad_request(f"the chat template could not render the messages: {type(e).__name__}: {e}",
                          "messages") from None
    params = s.fit_context(prompt, req, "messages")
    job = _submit(s, "chatcmpl-", prompt, params, notify, req.constraint)
    return job, _ChatRenderer(s, req, prompt, params, job)


def _read_images(s: Server, messages: list[dict], pixels: tuple[int | None, int | None]) -> tuple[list[dict], list]:
    """The messages with their image parts as template placeholders, and the images prepared for the
    vision tower (resize bounds: the request's ``pixels`` (min, max) where given, else the server's, else
    the checkpoint's); a 400 when the model cannot read images, an image is refused or unreadable, or the
    bounds are inconsistent."""
    if not has_image_parts(messages):
        return messages, []
    if s.model.config.vision is None:
        raise bad_request(f"the model '{s.model_name}' has no vision tower, so it cannot read images (send text "
                          f"only, or serve a checkpoint with a vision_config and model.visual.* weights)", "messages",
                          "images_unsupported")
    try:
        lo, hi = (p if p is not None else d for p, d in zip(pixels, s.image_pixels))
        try:
            s.model.image_processor.with_pixels(lo, hi)
        except LilyError as e:
            raise bad_request(f"'mm_processor_kwargs': {e}", "mm_processor_kwargs") from None
        messages, sources = extract_images(messages, s.image_policy)
        images, tokens = [], 0
        for source in sources:  # one at a time: a request of more image tokens than the context stops early
            images += s.model.prepare_images([source], min_pixels=lo, max_pixels=hi)
            tokens += images[-1].num_tokens
            if tokens >= s.worker.max_context:
                raise s.too_long(tokens, "messages")
        return messages, images
    except LilyError as e:
        raise bad_request(str(e), "messages", "invalid_image") from None


def _prepare_completion(s: Server, body: dict, notify):
    req = parse_completion(body, s.defaults)
    s.check_model(req.model)
    if isinstance(req.prompt, str):
        s.check_chars(len(req.prompt), "prompt")
    try:
        prompt = text_prompt(s.tokenizer, req.prompt, s.model.config.vocab_size, s.worker.max_context)
    except PromptTooLong as e:
        raise s.too_long(e.tokens, "prompt") from None
    except LilyError as e:
        raise bad_request(str(e), "prompt") from None
    params = s.fit_context(prompt, req, "prompt")
    job = _submit(s, "cmpl-", prompt, params, notify, req.constraint)
    return job, _CompletionRenderer(s, req, params, job)


async def _completion_endpoint(s: Server, request: HTTPRequest, prepare) -> Response:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def notify() -> None:  # from the worker thread
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    idle = s.worker.running is None and s.worker.queued == 0  # the job will run at once
    try:
        raw = await _read_body(s, request)
        body = _json(raw) if len(raw) <= INLINE_BODY_BYTES else None
        if body is not None and _inline(body):  # cheaper here than a hop to a thread and back
            job, renderer = prepare(s, body, notify)
        else:
            job, renderer = await run_in_threadpool(lambda: prepare(s, body if body is not None else _json(raw),
                                                                    notify))
    except _Gone:
        return _Nothing()
    return _JobResponse(s, job, renderer, wake, idle)


class _Nothing(Response):
    """No response: the client is gone."""

    def __init__(self):
        super().__init__()

    async def __call__(self, scope, receive, send) -> None:
        return


class _JobResponse(Response):
    """Relays a submitted job: one JSON response or a server-sent event stream. Cancels the job when
    the client disconnects (a task waits for uvicorn's http.disconnect), when a write blocks past
    the write timeout, or when the response ends early for any reason."""

    def __init__(self, s: Server, job: Job, renderer, wake: asyncio.Event, idle: bool):
        super().__init__()
        self.s, self.job, self.renderer, self.wake = s, job, renderer, wake
        self.idle = idle  # the worker was idle: the job runs at once

    async def __call__(self, scope, receive, send) -> None:
        conn = scope.get(CONNECTION)
        job, wake = self.job, self.wake
        gone = []

        async def listen():  # any message wakes the relay: a disconnect, or the end of stream (conn.eof)
            while True:
                message = await receive()
                wake.set()
                if message["type"] == "http.disconnect":
                    gone.append(True)
                    return

        async def write(message):
            if conn is not None and conn.flow.write_paused:  # the client does not read: bounded wait
                try:
                    await asyncio.wait_for(send(message), self.s.write_timeout)
                except asyncio.TimeoutError:
                    conn.transport.abort()
                    await asyncio.sleep(0)  # lets connection_lost run: uvicorn then sees a disconnect, not a bug
                    raise _Gone(f"the client stopped reading (a write blocked for {self.s.write_timeout:g} s)") \
                        from None
            else:
                await send(message)
            if gone:
                raise _Gone(DISCONNECTED)

        listener = asyncio.ensure_future(listen())
        reason = None
        state = {"started": False, "heartbeat": False}
        stream = self.renderer.stream
        try:
            try:
                if stream:
                    if self.idle:
                        await self._until_started(gone)
                    await write({"type": "http.response.start", "status": 200, "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")]})
                    state["started"] = True
                    for obj in self.renderer.start():
                        await write(_sse(obj))
                while True:
                    wake.clear()
                    item = job.poll()
                    if item is None:
                        if gone:
                            raise _Gone(DISCONNECTED)
                        if conn is not None and conn.eof and not stream:
                            await self._beat(write, state)
                            try:
                                await asyncio.wait_for(wake.wait(), POLL_SECONDS)
                            except asyncio.TimeoutError:
                                pass
                        else:
                            await wake.wait()
                        continue
                    kind, payload = item
                    if kind == "event":
                        for obj in self.renderer.event(payload):
                            await write(_sse(obj))
                        if gone:
                            raise _Gone(DISCONNECTED)
                    elif kind == "done":
                        final = self.renderer.done(payload)
                        if stream:
                            for obj in final:
                                await write(_sse(obj))
                            await write(_body(b"data: [DONE]\n\n", more=False))
                        elif state["heartbeat"]:
                            await write(_body(_dumps(final), more=False))
                        else:
                            await _json_response(200, final)(scope, receive, send)
                        return
                    elif kind == "cancelled":
                        raise APIError(503, "the request was cancelled: the server is shutting down", code="cancelled")
                    elif isinstance(payload, LilyError):
                        raise bad_request(str(payload))
                    else:
                        raise APIError(500, f"generation failed: {type(payload).__name__}: {payload}",
                                       code="internal_error")
            except APIError as e:
                if stream:  # a stream under way: report the error in it and end it
                    await write(_sse(e.body()))
                    await write(_body(b"data: [DONE]\n\n", more=False))
                elif state["heartbeat"]:  # the answer already started (a half-closed client)
                    await write(_body(_dumps(e.body()), more=False))
                else:
                    await _error_response(e)(scope, receive, send)
        except _Gone as e:
            reason = str(e) or DISCONNECTED
        except BaseException as e:
            reason = f"the response ended early ({type(e).__name__})"
            raise
        finally:
            listener.cancel()
            # A no-op once the job has ended; frees the engine otherwise (which logs the reason).
            job.cancel(reason or (DISCONNECTED if gone else "the response ended early"))
            job.notify = None

    async def _until_started(self, gone: list) -> None:
        """Wait (at most START_WAIT_SECONDS) until the worker reaches the job's first engine step, or the
        job ends, or the client goes. The worker's preparation and the writes of the headers and the role
        chunk are Python in two threads under one GIL: the worker's first puts the engine to work ~0.3 ms
        sooner, and the writes then run during the engine's pass (docs/perf-notes.md, tenth session)."""
        job, wake = self.job, self.wake
        deadline = asyncio.get_running_loop().time() + START_WAIT_SECONDS
        while not (job.started or job.pending or gone):
            try:
                await asyncio.wait_for(wake.wait(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return
            wake.clear()

    async def _beat(self, write, state) -> None:
        """A half-closed client's non-streamed answer starts at once (200, chunked) and gets a space
        every POLL_SECONDS: the write fails once the client is really gone (JSON allows the spaces)."""
        if not state["started"]:
            state["started"] = state["heartbeat"] = True
            await write({"type": "http.response.start", "status": 200,
                         "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await write(_body(b" "))


def _body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


def _sse(obj) -> dict:
    return _body(b"data: " + _dumps(obj) + b"\n\n")


def _dumps(obj) -> bytes:
    """Strict JSON (never a bare NaN or Infinity: output.py maps non-finite logprobs first)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def default_api_key() -> str | None:
    return os.environ.get("LILY_API_KEY") or None
