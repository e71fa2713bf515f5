"""Fuzzing lily serve with hypothesis (issue 14): no request, however malformed, gets a 5xx.

Two layers. The HTTP layer: raw request lines, headers (framing, Expect, Connection, junk) and
bodies sent over a socket to both completion endpoints and the plain routes; every answer must be a
status below 500 (or no answer, for a request that never completed before the client shut its
side). The request schemas: bodies drawn from the OpenAPI schemas with at most one mutation
(``test_server.request_bodies``), streamed or not, against both endpoints. The default settings
take a few seconds; the ``slow`` variants run many more examples.

The engine runs scripted text (``Server(source=...)``): what is fuzzed is everything before and
around it, where the model's output does not matter.
"""
from __future__ import annotations

import json
import re
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lily
from lily.checkpoint.tiny import tiny_checkpoint
from lily.server import Server
from test_server import COMPONENTS, Script, request_bodies

NAME = "tiny"
STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


@pytest.fixture(scope="module")
def model() -> lily.Model:
    return lily.Model.load(tiny_checkpoint(), device="cpu", max_context=512)


@pytest.fixture(scope="module")
def server(model):
    script = Script()
    script.pieces = ["r\n</think>\n\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n"
                     "</tool_call>"]
    with Server(model, port=0, model_name=NAME, source=script, request_timeout=2.0, keepalive_timeout=2.0,
                max_queue=8, max_body_bytes=1 << 20) as s:
        yield s


def exchange(server, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data``, shut the write side (the server sees the end of the request), read the answer."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as c:
        c.sendall(data)
        try:
            c.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                part = c.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            out += part
        return out


def statuses(reply: bytes) -> list[int]:
    """The status of the answer (after any 100 Continue)."""
    found = []
    rest = reply
    while True:
        m = STATUS.match(rest)
        if not m:
            return found
        found.append(int(m.group(1)))
        if found[-1] != 100:
            return found
        rest = rest[rest.find(b"\r\n\r\n") + 4:]


PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/completions/", "/health", "/v1/models", "/v1/models/tiny",
         "/openapi.json", "/v1/nothing", "/v1/completions?x=1", "/v1/models/%00%1b", "*", "//v1//completions"]
HEADER_NAMES = ["Content-Length", "Transfer-Encoding", "Content-Type", "Authorization", "Connection", "Expect",
                "Host", "X-Junk", "Content-Length "]
HEADER_VALUES = ["0", "2", "17", "-1", "+2", "0x2", "99999999999999999999", "2, 2", "chunked", "identity",
                 "gzip, chunked", "close", "keep-alive", "100-continue", "application/json", "Bearer x", "", " 2 "]
TOKEN_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x7e)


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Hi", "max_tokens": 2}
VALID = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
         ("/v1/chat/completions", {**CHAT, "stream": True}), ("/v1/completions", {**COMPLETION, "stream": True}),
         ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}})]


def bodies():
    return (st.sampled_from([b for _, b in VALID]).map(lambda b: json.dumps(b).encode())
            | st.binary(max_size=40) | st.just(b"") | st.just(b"0\r\n\r\n") | st.just(b"5\r\nhello\r\n0\r\n\r\n"))


@st.composite
def raw_requests(draw) -> tuple[bool, bytes]:
    """(valid, one HTTP request as bytes). A third are valid completion requests (framed exactly,
    optional headers a client may send); the rest have one or more mutations of the method, the
    target, the version, the framing, the headers or the bytes."""
    valid = draw(st.integers(0, 2)) == 0
    path, body = draw(st.sampled_from(VALID))
    body = json.dumps(body).encode()
    method, version = "POST", "HTTP/1.1"
    headers: list[tuple[str, str]] = [("Host", "x"), ("Content-Length", str(len(body)))]
    for name, value in draw(st.lists(st.sampled_from([("Content-Type", "application/json"), ("Connection", "close"),
                                                      ("Connection", "keep-alive"), ("Expect", "100-continue"),
                                                      ("Authorization", "Bearer x"), ("Accept", "*/*")]),
                                     max_size=3, unique=True)):
        headers.append((name, value))
    if not valid:
        mutations = draw(st.lists(st.sampled_from(["method", "path", "version", "framing", "header", "body", "host",
                                                   "byte"]), min_size=1, max_size=3))
        if "method" in mutations:
            method = draw(st.sampled_from(["GET", "HEAD", "PUT", "OPTIONS", "DELETE"])
                          | st.text(TOKEN_CHARS, min_size=1, max_size=6))
        if "path" in mutations:
            path = draw(st.sampled_from(PATHS) | st.text(TOKEN_CHARS, min_size=1, max_size=12).map(lambda t: "/" + t))
        if "version" in mutations:
            version = draw(st.sampled_from(["HTTP/1.0", "HTTP/2.0", "HTTP/1.1 x", "HTTP/1", "http/1.1"]))
        if "body" in mutations:
            body = draw(bodies())
            headers[1] = ("Content-Length", str(len(body)))
        if "framing" in mutations:
            framing = draw(st.sampled_from(["short", "long", "none", "chunked", "two", "both"]))
            del headers[1]
            if framing == "short":
                headers.append(("Content-Length", str(max(len(body) - 3, 0))))
            elif framing == "long":
                headers.append(("Content-Length", str(len(body) + 5)))
            elif framing == "chunked":
                headers.append(("Transfer-Encoding", "chunked"))
            elif framing == "two":
                headers += [("Content-Length", str(len(body))), ("Content-Length", str(len(body) + 1))]
            elif framing == "both":
                headers += [("Content-Length", str(len(body))), ("Transfer-Encoding", "chunked")]
        if "host" in mutations:
            del headers[0]
        if "header" in mutations:
            for _ in range(draw(st.integers(1, 3))):
                headers.append((draw(st.sampled_from(HEADER_NAMES) | st.text(TOKEN_CHARS, min_size=1, max_size=8)),
                                draw(st.sampled_from(HEADER_VALUES) | st.text(max_size=10))))
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    data = head.encode("utf-8", "surrogatepass") + body
    if not valid and "byte" in mutations:  # one byte of the head replaced
        i = draw(st.integers(0, len(head) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    return valid, data


def check_http(server, request: tuple[bool, bytes]) -> None:
    valid, data = request
    reply = exchange(server, data)
    found = statuses(reply)
    assert reply == b"" or found, reply[:200]  # an answer is an HTTP response, or there is none
    assert all(code < 500 for code in found), (data, reply[:400])
    if valid:
        assert found and found[-1] == 200, (data, reply[:400])
        assert b'"error"' not in reply and (b'"finish_reason": "' in reply), reply[:400]
    if found and found[-1] >= 400:  # errors are OpenAI error objects (HEAD answers have no body)
        body = reply.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in reply else b""
        if body and not data.startswith(b"HEAD "):
            try:
                err = json.loads(body)["error"]
            except ValueError:  # a chunked error body (a half-closed client's started answer)
                return
            assert err["message"] and err["type"] == "invalid_request_error", err


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=raw_requests())
def test_fuzz_http_requests_never_get_5xx(server, request):
    check_http(server, request)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=raw_requests())
def test_fuzz_http_requests_never_get_5xx_long(server, request):
    check_http(server, request)


def post(server, path: str, body: bytes) -> tuple[int, bytes]:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((server.host, server.port), timeout=10) as c:
        c.sendall(head + body)
        out = b""
        while True:
            part = c.recv(65536)
            if not part:
                break
            out += part
    found = statuses(out)
    assert found, out[:200]
    return found[-1], out.split(b"\r\n\r\n", 1)[1]


def check_schema(server, path: str, body) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, reply = post(server, path, raw)
    assert status < 500, (body, reply[:400])
    if status == 200 and isinstance(body, dict) and body.get("stream") is True:
        assert reply.rstrip().endswith(b"data: [DONE]\n\n0") or b"data: [DONE]" in reply, reply[-200:]
        assert b'"error"' not in reply, reply[:400]


ENDPOINTS = st.sampled_from([("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")])


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_schema_bodies_streamed_or_not_never_get_5xx(server, data):
    path, name = data.draw(ENDPOINTS)
    body = data.draw(request_bodies(name))
    if data.draw(st.booleans()):
        body["stream"] = True
    check_schema(server, path, body)


@pytest.mark.slow
@settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_schema_bodies_never_get_5xx_long(server, data):
    path, name = data.draw(ENDPOINTS)
    body = data.draw(request_bodies(name) | st.binary(max_size=40))
    if isinstance(body, dict) and data.draw(st.booleans()):
        body["stream"] = data.draw(st.sampled_from([True, False, None, 1, "yes"]))
    check_schema(server, path, body)


def test_the_server_is_healthy_after_the_fuzzing(server):
    status, reply = post(server, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())
    assert status == 200 and json.loads(reply)["choices"][0]["text"]
    deadline = time.monotonic() + 5
    while server.open_connections > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.open_connections == 0  # every fuzzed connection was closed
    assert COMPONENTS  # the schemas the bodies were drawn from
