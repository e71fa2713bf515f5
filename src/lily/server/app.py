"""The HTTP layer: routes, API key, JSON in and out, server-sent events, disconnects.

``Server`` runs a standard-library ``ThreadingHTTPServer`` (one thread per connection, HTTP/1.1
keep-alive) in front of one ``Engine``. A handler thread validates and tokenizes its request,
submits a job, then relays the job's events: as one JSON response, or as ``text/event-stream``
chunks ending in ``data: [DONE]``. While it waits it checks whether the client is still there; if
not, it cancels the job, which frees the engine at the next token.
"""
from __future__ import annotations

import dataclasses
import hmac
import io
import json
import os
import re
import select
import socket
import sys
import threading
import time
import traceback
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..errors import LilyError
from .engine import DEFAULT_CACHE_MIB, DEFAULT_MAX_QUEUE, Engine, Job, QueueFull, ShuttingDown, Source
from .errors import APIError, bad_request
from .output import ChatOutput, CompletionLogprobs, chat_logprob, usage
from .parse import Request, parse_chat, parse_completion
from .prompt import Prompt, PromptTooLong, chat_prompt, text_prompt
from .schema import openapi

MAX_BODY_BYTES = 32 << 20
POLL_SECONDS = 0.1  # how often a waiting handler checks that its client is still connected
RETRY_AFTER_SECONDS = 1
MAX_CHARS_PER_TOKEN = 32  # default prompt-character limit per token of context (max_prompt_chars)
# Limits of the HTTP layer (docs/server.md lists them all with their defaults).
MAX_CONNECTIONS = 256       # open connections at once; more are answered 503 and closed at once
REQUEST_TIMEOUT = 30.0      # seconds to receive a request's line, headers and body, from its first byte
KEEPALIVE_TIMEOUT = 15.0    # seconds an idle keep-alive connection waits for its next request
WRITE_TIMEOUT = 60.0        # seconds one write to a client that does not read may block
SHUTDOWN_GRACE = 10.0       # seconds close() waits for running handlers to end their responses

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_DIGITS = re.compile(r"[0-9]{1,20}")


def printable(text: str) -> str:
    """``text`` with control characters escaped, safe to write to a log or a terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class _DeadlineReader(io.RawIOBase):
    """The connection's read side with a deadline: every recv gets only the time left, so a client
    that sends a byte every few seconds cannot hold a request open past the deadline."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request took too long to arrive")
            self.sock.settimeout(left)
        return self.sock.recv_into(b)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # listen backlog: many clients may connect at once
    app: "Server"

    def __init__(self, *args, **kw):
        self._lock = threading.Lock()
        self.connections = 0  # open connections (handler threads)
        self.active = 0       # handlers inside a request
        self.idle = threading.Condition(self._lock)
        super().__init__(*args, **kw)

    def process_request(self, request, client_address):
        with self._lock:
            full = self.connections >= self.app.max_connections
            if not full:
                self.connections += 1
        if full:
            _refuse(request, self.app.max_connections)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._lock:
                self.connections -= 1
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self.connections -= 1

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client that vanished mid-request: nothing to report
            return
        super().handle_error(request, client_address)


def _refuse(sock: socket.socket, limit: int) -> None:
    """Answer a connection over the cap with a short 503 and close it, never blocking."""
    body = json.dumps({"error": {"message": f"too many open connections (the limit is {limit}); retry later",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    try:
        sock.setblocking(False)
        sock.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Retry-After: %d\r\nContent-Length: %d\r\n\r\n%s" % (RETRY_AFTER_SECONDS, len(body), body))
    except OSError:
        pass
    finally:
        try:
            sock.close()
        except OSError:
            pass


class Server:
    """An OpenAI-compatible server for one loaded ``lily.Model``.

    ``port=0`` picks a free port (see ``url``). ``api_key``: when set, /v1/* needs
    ``Authorization: Bearer KEY``. ``model_name``: the id clients send and /v1/models lists;
    ``aliases`` are accepted too. ``max_queue``: requests that may wait while one runs.
    ``cache_mib``: the prefix-snapshot budget. ``source``: a test hook that replaces the model's
    generation (see engine.Source).
    """

    def __init__(self, model, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 model_name: str | None = None, aliases: tuple[str, ...] = (), max_queue: int = DEFAULT_MAX_QUEUE,
                 cache_mib: int = DEFAULT_CACHE_MIB, max_context: int | None = None, source: Source | None = None,
                 log: bool = False, max_body_bytes: int = MAX_BODY_BYTES, max_connections: int = MAX_CONNECTIONS,
                 request_timeout: float = REQUEST_TIMEOUT, keepalive_timeout: float = KEEPALIVE_TIMEOUT,
                 write_timeout: float = WRITE_TIMEOUT, max_prompt_chars: int | None = None,
                 allow_control_tokens: bool = False):
        self.model = model
        self.tokenizer = model.tokenizer  # loaded once here, shared by the handler threads
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
        self.engine = Engine(model, max_queue=max_queue, cache_bytes=int(cache_mib) << 20, max_context=max_context,
                             source=source)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_Server", (_HTTPServer,), {"address_family": family})
        try:
            self.httpd = server_class((host, port), Handler)
        except OSError:
            self.engine.close()
            raise
        self.httpd.app = self
        self._thread: threading.Thread | None = None
        # Prompt text longer than this cannot fit the context (no token spans more characters): it is
        # refused before tokenizing. Default: MAX_CHARS_PER_TOKEN characters per token of context.
        self.max_prompt_chars = max_prompt_chars or self.engine.max_context * MAX_CHARS_PER_TOKEN

    @property
    def host(self) -> str:
        return self.httpd.server_address[0]

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> "Server":
        """Serve from a background thread (returns at once)."""
        self._thread = threading.Thread(target=self.serve_forever, name="lily-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting connections, cancel what is queued or running, and free the socket."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.engine.close()  # running and queued jobs end as cancelled: their handlers send the error event
        deadline = time.monotonic() + SHUTDOWN_GRACE
        with self.httpd.idle:
            while self.httpd.active and time.monotonic() < deadline:
                self.httpd.idle.wait(0.05)
        self.httpd.server_close()
        self.httpd.app = None  # no cycle keeps the model's objects alive after close

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def model_object(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lily",
                "max_model_len": self.engine.max_context}

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
                found = self.control_tokens.search(m.get(field) or "")
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
                              f"(a context of {self.engine.max_context} tokens)", field, "context_length_exceeded")

    def too_long(self, tokens: int, field: str) -> APIError:
        return bad_request(f"the prompt has more than {tokens} tokens, but the context holds "
                           f"{self.engine.max_context}", field, "context_length_exceeded")

    def fit_context(self, prompt: Prompt, req: Request, prompt_field: str):
        """The request's SamplingParams with max_tokens fitted to the context; 400 when it cannot fit."""
        n, room = len(prompt.ids), self.engine.max_context
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


class _Gone(Exception):
    """The client disconnected."""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "lily"
    disable_nagle_algorithm = True  # small SSE chunks and responses go out at once
    server: _HTTPServer

    @property
    def app(self) -> Server:
        return self.server.app

    def setup(self) -> None:
        super().setup()
        self._raw = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._raw, 64 << 10)
        self._eof = False  # the client half-closed (sent its whole request and shut its write side)

    def handle_one_request(self) -> None:
        """One request: wait up to keepalive_timeout for its first byte, then read its line, headers
        and body within request_timeout (a deadline over all reads, not per read)."""
        app = self.app
        self._raw.deadline = time.monotonic() + app.keepalive_timeout
        try:
            if not self.rfile.peek(1):
                self.close_connection = True
                return
        except (TimeoutError, OSError):
            self.close_connection = True
            return
        self._raw.deadline = time.monotonic() + app.request_timeout
        super().handle_one_request()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        if self.app is not None and self.app.log:
            sys.stderr.write(f"lily serve: {self.address_string()} {printable(format % args)}\n")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # --- dispatch -------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        httpd = self.server
        with httpd.idle:
            httpd.active += 1
        try:
            self._dispatch_request(method)
        finally:
            with httpd.idle:
                httpd.active -= 1
                httpd.idle.notify_all()

    def _dispatch_request(self, method: str) -> None:
        self._started = False  # whether a response status line has been sent
        self._job: Job | None = None
        self._heartbeat = False  # a non-streamed response already started (see _client_gone)
        try:
            try:
                raw = self._read_body()
            except TimeoutError:
                self.close_connection = True
                raise APIError(408, f"the request body did not arrive within {self.app.request_timeout:g} s",
                               code="request_timeout") from None
            self._raw.deadline = None  # reading is done: writes get their own timeout
            self.connection.settimeout(self.app.write_timeout)
            path = unquote(urlsplit(self.path).path).rstrip("/") or "/"
            if path.startswith("/v1/"):
                self._authorize()
            route = self._route(method, path)
            route(raw)
        except APIError as e:
            self._cancel()
            self._send_error(e)
        except (OSError, _Gone):  # broken pipe, reset, write timeout: the client went away
            self._cancel()  # free the engine
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug: answer 500 rather than drop the connection
            self._cancel()
            traceback.print_exc(file=sys.stderr)
            self._send_error(APIError(500, f"internal server error: {type(e).__name__}: {e}", code="internal_error"))

    def _cancel(self) -> None:
        if self._job is not None:
            self._job.cancel()

    def _route(self, method: str, path: str):
        get = {"/health": self._health, "/v1/models": self._models, "/openapi.json": self._openapi}
        post = {"/v1/chat/completions": self._chat, "/v1/completions": self._completion}
        if path.startswith("/v1/models/"):
            allowed, handler = "GET", lambda raw: self._model(path[len("/v1/models/"):])
        elif path in get:
            allowed, handler = "GET", get[path]
        elif path in post:
            allowed, handler = "POST", post[path]
        else:
            raise APIError(404, f"no such route: {method} {path} (see GET /openapi.json)", code="not_found")
        if method != allowed:
            raise APIError(405, f"{path} takes {allowed}, not {method}", code="method_not_allowed",
                           headers={"Allow": allowed})
        return handler

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise APIError(411, "chunked request bodies are not supported; send Content-Length", code="length_required")
        lengths = self.headers.get_all("Content-Length") or []
        if len(lengths) > 1:  # ambiguous framing: a proxy may read the body differently (smuggling)
            self.close_connection = True
            raise bad_request(f"{len(lengths)} Content-Length headers; send exactly one",
                              code="invalid_content_length")
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise bad_request("Transfer-Encoding is not supported; send Content-Length",
                              code="invalid_transfer_encoding")
        if not lengths:
            return b""
        length = lengths[0].strip()
        if not _DIGITS.fullmatch(length):
            self.close_connection = True
            raise bad_request(f"invalid Content-Length {printable(length[:40])!r}", code="invalid_content_length")
        n = int(length)
        if n > self.app.max_body_bytes:
            self.close_connection = True
            raise APIError(413, f"the request body has {n} bytes; the limit is {self.app.max_body_bytes}",
                           code="request_too_large")
        data = self.rfile.read(n)
        if len(data) < n:
            self.close_connection = True
            raise bad_request(f"the request body ended after {len(data)} of {n} bytes", code="incomplete_body")
        return data

    def _authorize(self) -> None:
        key = self.app.api_key
        if key is None:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            what = "missing" if not header else "incorrect"
            raise APIError(401, f"{what} API key: send 'Authorization: Bearer KEY' with the server's key",
                           code="invalid_api_key")

    @staticmethod
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

    # --- plain routes ---------------------------------------------------------------------------

    def _health(self, raw: bytes) -> None:
        self._send_json(200, {"status": "ok", "model": self.app.model_name, **self.app.engine.stats()})

    def _models(self, raw: bytes) -> None:
        self._send_json(200, {"object": "list", "data": [self.app.model_object()]})

    def _model(self, name: str) -> None:
        self.app.check_model(name)
        self._send_json(200, self.app.model_object())

    def _openapi(self, raw: bytes) -> None:
        from .. import __version__

        self._send_json(200, openapi(__version__))

    # --- completions ----------------------------------------------------------------------------

    def _chat(self, raw: bytes) -> None:
        app = self.app
        req = parse_chat(self._json(raw), app.defaults)
        app.check_model(req.model)
        app.check_chars(sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "")
                            for m in req.messages), "messages")
        app.check_control_tokens(req.messages)
        try:
            prompt = chat_prompt(app.tokenizer, req.messages, req.tools, req.template_kwargs, app.engine.max_context)
        except PromptTooLong as e:
            raise app.too_long(e.tokens, "messages") from None
        except LilyError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 - the template failed on these messages
            raise bad_request(f"the chat template could not render the messages: {type(e).__name__}: {e}",
                              "messages") from None
        params = app.fit_context(prompt, req, "messages")
        job = self._submit("chatcmpl-", prompt, params)
        out = ChatOutput(prompt.thinking, req.tool_defs if req.parse_tools else None)
        want_logprobs = params.num_logprobs >= 0
        head = {"id": job.id, "created": int(time.time()), "model": app.model_name}
        if not req.stream:
            logprobs = []
            result = None
            for kind, payload in self._events(job):
                if kind == "event":
                    out.feed(payload)
                    if want_logprobs and payload.logprobs is not None:
                        logprobs.append(chat_logprob(app.tokenizer, payload.logprobs))
                else:
                    result = payload
            out.finish()
            choice = {"index": 0, "message": out.message(),
                      "logprobs": {"content": logprobs} if want_logprobs else None,
                      "finish_reason": out.finish_reason(result)}
            self._send_json(200, {**head, "object": "chat.completion", "choices": [choice], "usage": usage(result),
                                  "system_fingerprint": None})
            return
        chunk = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}
        if req.include_usage:
            chunk["usage"] = None

        def send(delta: dict, logprobs=None, finish=None):
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            self._sse({**chunk, "choices": [choice]})

        self._start_stream()
        send({"role": "assistant", "content": ""})
        for kind, payload in self._events(job):
            if kind == "event":
                delta = out.feed(payload)
                lp = None
                if want_logprobs and payload.logprobs is not None:
                    lp = {"content": [chat_logprob(app.tokenizer, payload.logprobs)]}
                if delta or lp:
                    send(delta, lp)
            else:
                delta = out.finish()
                if delta:
                    send(delta)
                send({}, finish=out.finish_reason(payload))
                if req.include_usage:
                    self._sse({**chunk, "choices": [], "usage": usage(payload)})
        self._end_stream()

    def _completion(self, raw: bytes) -> None:
        app = self.app
        req = parse_completion(self._json(raw), app.defaults)
        app.check_model(req.model)
        if isinstance(req.prompt, str):
            app.check_chars(len(req.prompt), "prompt")
        try:
            prompt = text_prompt(app.tokenizer, req.prompt, app.model.config.vocab_size, app.engine.max_context)
        except PromptTooLong as e:
            raise app.too_long(e.tokens, "prompt") from None
        except LilyError as e:
            raise bad_request(str(e), "prompt") from None
        params = app.fit_context(prompt, req, "prompt")
        job = self._submit("cmpl-", prompt, params)
        n = params.num_logprobs
        lps = CompletionLogprobs(app.tokenizer, n > 0) if n >= 0 else None
        head = {"id": job.id, "object": "text_completion", "created": int(time.time()), "model": app.model_name,
                "system_fingerprint": None}
        if not req.stream:
            texts, entries, result = [], [], None
            for kind, payload in self._events(job):
                if kind == "event":
                    texts.append(payload.text)
                    if lps is not None and payload.logprobs is not None:
                        entries.append(lps.entry(payload.logprobs))
                else:
                    result = payload
            choice = {"index": 0, "text": "".join(texts),
                      "logprobs": CompletionLogprobs.merge(entries, n > 0) if lps is not None else None,
                      "finish_reason": result.finish_reason}
            self._send_json(200, {**head, "choices": [choice], "usage": usage(result)})
            return
        if req.include_usage:
            head["usage"] = None
        self._start_stream()
        for kind, payload in self._events(job):
            if kind == "event":
                lp = lps.entry(payload.logprobs) if lps is not None and payload.logprobs is not None else None
                if payload.text or lp or payload.finish_reason:
                    choice = {"index": 0, "text": payload.text, "logprobs": lp, "finish_reason": None}
                    self._sse({**head, "choices": [choice]})
            else:
                self._sse({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                "finish_reason": payload.finish_reason}]})
                if req.include_usage:
                    self._sse({**head, "choices": [], "usage": usage(payload)})
        self._end_stream()

    # --- jobs -----------------------------------------------------------------------------------

    def _submit(self, prefix: str, prompt: Prompt, params) -> Job:
        job = Job(prefix + uuid.uuid4().hex, prompt, params)
        try:
            self.app.engine.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}; retry after {RETRY_AFTER_SECONDS} s",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), code="shutting_down") from None
        self._job = job
        return job

    def _events(self, job: Job):
        """Yield the job's ("event", GenerationEvent) items and finally ("done", Generation); raise
        _Gone when the client disconnects (``_dispatch`` then cancels the job), APIError when the job
        failed."""
        checked = time.monotonic()
        while True:
            item = job.next_item(POLL_SECONDS)
            now = time.monotonic()
            if item is None or now - checked >= POLL_SECONDS:  # also while tokens keep coming
                checked = now
                if self._client_gone():
                    raise _Gone()
            if item is None:
                continue
            kind, payload = item
            if kind == "event":
                yield item
            elif kind == "done":
                yield item
                return
            elif kind == "cancelled":
                raise APIError(503, "the request was cancelled: the server is shutting down", code="cancelled")
            else:
                if isinstance(payload, LilyError):
                    raise bad_request(str(payload))
                raise APIError(500, f"generation failed: {type(payload).__name__}: {payload}",
                               code="internal_error")

    def _client_gone(self) -> bool:
        """Whether the peer is gone. poll() (not select(), which fails on descriptors >= 1024) says
        whether the socket is readable; an error or reset means gone. An end of stream (the client
        shut its write side) may be a half-close of a client still waiting for the answer: from
        then on a stream finds out by its writes; a non-streamed answer starts at once (status 200,
        chunked) and writes a space every poll, which fails once the client is really gone. A
        request that then fails ends with its error object as the body (JSON allows the spaces)."""
        if self._eof:
            if self._started and not self._heartbeat:
                return False  # a stream: the next event's write finds out
            self._beat()
            return False
        try:
            p = select.poll()
            p.register(self.connection, select.POLLIN | select.POLLPRI)
            events = p.poll(0)
            if not events:
                return False
            if events[0][1] & (select.POLLERR | select.POLLNVAL):
                return True
            if self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b"":
                return False  # pipelined bytes of a next request: still there
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return True
        self._eof = True
        if not self._started:
            self._beat()
        return False

    def _beat(self) -> None:
        """Start a non-streamed answer early (see _client_gone) or keep it alive; raises OSError when
        the client is gone."""
        if not self._started:
            self.send_response(200)
            self._started = self._heartbeat = True
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
        self._chunk(b" ")

    # --- writing --------------------------------------------------------------------------------

    def _send_json(self, status: int, obj, headers: dict | None = None) -> None:
        data = _dumps(obj)
        if self._heartbeat:  # the answer already started (a half-closed client): finish its body
            self._chunk(data)
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_response(status)
        self._started = True
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_error(self, e: APIError) -> None:
        if getattr(self, "_heartbeat", False):
            try:
                self._send_json(e.status, e.body())
            except OSError:
                pass
            self.close_connection = True
            return
        if getattr(self, "_started", False):
            # A stream is under way: report the error in it and end it.
            try:
                self._sse(e.body())
                self._end_stream()
            except OSError:
                pass
            self.close_connection = True
            return
        try:
            self._send_json(e.status, e.body(), e.headers)
        except OSError:
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors the base class detects (malformed request line, headers too long, unknown method)
        as OpenAI error objects."""
        if code == HTTPStatus.NOT_IMPLEMENTED:  # an HTTP method this server does not serve
            code = HTTPStatus.METHOD_NOT_ALLOWED
        self.close_connection = True
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._started = self._heartbeat = False
        self._send_error(APIError(code, printable(message or phrase), code=phrase.lower().replace(" ", "_")))

    def _start_stream(self) -> None:
        self.send_response(200)
        self._started = True
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Accel-Buffering", "no")
        self.end_headers()

    def _sse(self, obj) -> None:
        self._chunk(b"data: " + _dumps(obj) + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))

    def _end_stream(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")


def _dumps(obj) -> bytes:
    """Strict JSON (never a bare NaN or Infinity: output.py maps non-finite logprobs first)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def default_api_key() -> str | None:
    return os.environ.get("LILY_API_KEY") or None
