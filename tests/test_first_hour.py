"""Issue 15, "First hour with lily": safe defaults and the conventions users of mlx-lm, llama-cpp-python
and vLLM expect. Each test failed before its fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import lily
from lily import LilyError
from lily.checkpoint.tiny import tiny_checkpoint
from lily.cli import read_prompts
from lily.server.errors import APIError
from lily.server.parse import parse_chat, parse_completion
from server_fakes import Slow

ROOT = Path(__file__).parent.parent
USER = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def model() -> lily.Model:
    return lily.Model.load(tiny_checkpoint(), device="cpu", max_context=256)


def run(*args, stdin=None, timeout=300):
    env = dict(os.environ, LILY_CACHE_DIR=str(tiny_checkpoint().parent.parent))
    return subprocess.run([sys.executable, "-m", "lily", *args], capture_output=True, text=True, env=env,
                          input=stdin, timeout=timeout)


# --- 1. defaults finish ----------------------------------------------------------------------------

def test_default_max_tokens_comes_from_generation_config(model):
    assert model.generation_config["max_new_tokens"] == 32 == model.default_max_tokens
    r = model.chat(USER)  # the README snippet: finishes after max_new_tokens, says so
    assert (r.finish_reason, len(r.token_ids)) == ("length", 32)
    r = model.generate("Hello", temperature=0)
    assert (r.finish_reason, len(r.token_ids)) == ("length", 32)


def test_default_max_tokens_without_generation_config(tmp_path):
    from lily.model import DEFAULT_MAX_TOKENS

    path = tmp_path / "ckpt"
    lily.make_checkpoint(path, "tiny")
    gen = json.loads((path / "generation_config.json").read_text())
    del gen["max_new_tokens"]
    (path / "generation_config.json").write_text(json.dumps(gen))
    with lily.Model.load(path, device="cpu", max_context=40) as m:
        assert m.default_max_tokens == DEFAULT_MAX_TOKENS
        r = m.generate([1, 2, 3], temperature=0)  # the context ends it, with finish_reason "length"
        assert r.finish_reason == "length" and len(r.token_ids) == 40 - 3 + 1


def test_server_default_max_tokens(model):
    req = parse_chat({"messages": USER}, model.default_sampling())
    assert req.params.max_tokens is None and req.max_tokens_field is None  # the engine resolves it: 32


# --- 2. busy session ------------------------------------------------------------------------------

@pytest.mark.parametrize("call", ["reset", "restore", "snapshot"])
def test_state_changes_refused_while_a_stream_is_open(model, call):
    session = model.new_session()
    session.prefill([1, 2, 3])
    snap = session.snapshot()
    stream = model.generate([5, 6, 7], max_tokens=8, session=session, stream=True)
    next(stream)
    with pytest.raises(LilyError, match="busy"):
        getattr(session, call)(*([snap] if call == "restore" else []))
    assert len(stream.result().token_ids) == 8  # the stream was not disturbed
    getattr(session, call)(*([snap] if call == "restore" else []))  # allowed once it is done


# --- 3. max_context bound -------------------------------------------------------------------------

def test_max_context_bounded_by_max_position_embeddings(model):
    with pytest.raises(LilyError, match="max_position_embeddings"):
        model.new_session(10**9)
    with pytest.raises(LilyError, match="max_position_embeddings"):
        lily.Model.load(tiny_checkpoint(), device="cpu", max_context=10_000_000)
    r = run("serve", "--max-context", "10000000", "--port", "0")
    assert r.returncode == 2 and "max_position_embeddings" in r.stderr


# --- 4. flags honoured or refused -----------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["generate", "-o", "out.jsonl", "Hi"], "--output is where --input writes"),
    (["chat", "--logprobs", "2"], "--logprobs is not shown by 'lily chat'"),
    (["generate", "--system", "S", "Hi"], "--system applies to chat prompts"),
])
def test_ignored_flags_are_refused(args, message):
    r = run(*args, stdin="")
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_quiet_logprobs_are_printed():
    r = run("generate", "-q", "--logprobs", "1", "-n", "2", "Hi")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("  [") == 2


def test_jsonl_honours_chat_and_system(model, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('"Hi"\n{"messages": [{"role": "user", "content": "Yo"}]}\n')
    r = run("generate", "-q", "-i", str(src), "-o", str(out), "--chat", "--system", "Be brief.", "--no-think",
            "--greedy", "-n", "3")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    session = model.new_session()
    for row, user in zip(rows, ("Hi", "Yo")):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]
        expected = model.chat(messages, temperature=0, max_tokens=3, enable_thinking=False, session=session)
        assert row["token_ids"] == expected.token_ids


# --- 5. several completion prompts ----------------------------------------------------------------

def test_several_completion_prompts_are_named(model):
    with pytest.raises(APIError, match="one prompt per request is supported, got 2 prompts"):
        parse_completion({"prompt": ["a", "b"]}, model.default_sampling())
    assert parse_completion({"prompt": ["a"]}, model.default_sampling()).prompt == "a"


# --- 6. one validation ----------------------------------------------------------------------------

def test_api_and_server_agree(model):
    # top_k = -1 is "off" in both.
    assert lily.SamplingParams(top_k=-1).top_k == 0
    assert parse_chat({"messages": USER, "top_k": -1}, model.default_sampling()).params.top_k == 0
    # Image parts on a checkpoint without a vision tower: refused, naming it (the server: 400, test_vision_api).
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(LilyError, match="has no vision tower"):
        model.chat(image, max_tokens=1)
    # Video parts: refused by both.
    video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:,"}}]}]
    with pytest.raises(LilyError, match="video and audio input are not supported"):
        model.chat(video, max_tokens=1)
    with pytest.raises(APIError, match="video"):
        parse_chat({"messages": video}, model.default_sampling())
    # A user message without content: refused by both.
    with pytest.raises(LilyError, match="is required for user messages"):
        model.chat([{"role": "user"}], max_tokens=1)
    with pytest.raises(APIError, match="is required for user messages"):
        parse_chat({"messages": [{"role": "user"}]}, model.default_sampling())
    # max_tokens beyond the context: an error (the server: 400 context_length_exceeded), not a silent cut.
    with pytest.raises(LilyError, match="exceeds the session's max_context"):
        model.generate("Hi", max_tokens=1000)
    # Text parts are joined, developer is system: the same prompt as the server renders.
    parts = [{"role": "developer", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    assert model.tokenizer.apply_chat_template(parts + USER) == \
        model.tokenizer.apply_chat_template([{"role": "system", "content": "AB"}] + USER)


# --- 7. small defects -----------------------------------------------------------------------------

def test_automatic_jsonl_ids_never_collide(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('"a"\n{"id": 2, "prompt": "b"}\n"c"\n{"id": 0, "prompt": "d"}\n"e"\n')
    ids = [pid for pid, _ in read_prompts(src)]
    assert len(set(ids)) == 5 and ids[1] == 2 and ids[3] == 0
    assert ids == [pid for pid, _ in read_prompts(src)]  # stable: resuming needs it


def test_make_checkpoint_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    r = run("make-checkpoint", str(tmp_path))
    assert r.returncode == 2 and "--overwrite" in r.stderr
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_serve_quiet_help_is_its_own():
    r = run("serve", "--help")
    assert "start or stop lines" in r.stdout and "MODEL" in r.stdout


def test_stream_repr_after_close(model):
    stream = model.generate("Hi", max_tokens=5, stream=True)
    next(stream)
    stream.close()
    assert "running" not in repr(stream) and "cancelled" in repr(stream)


def test_a_cancelled_request_gets_a_log_line(model, capfd):
    import re
    import socket
    import time

    from lily.server import Server

    def wait_for(cond):
        deadline = time.monotonic() + 20
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.02)

    with Server(model, port=0, model_name="tiny", source=Slow(200, 0.01), log=True) as s:
        body = json.dumps({"prompt": "Hi", "max_tokens": 200, "stream": True}).encode()
        c = socket.create_connection((s.host, s.port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        c.settimeout(10)
        data = b""
        while data.count(b"data: ") < 4:  # a few tokens streamed, then the client goes away
            data += c.recv(65536)
        c.close()
        wait_for(lambda: s.worker.records and s.worker.records[-1]["outcome"] == "cancelled")
        record = s.worker.records[-1]
        time.sleep(0.1)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if " cancelled " in line]
    assert len(lines) == 1, err
    m = re.fullmatch(r"lily serve: request (cmpl-\w+) cancelled after (\d+) completion tokens? "
                     r"\(prompt (\d+), cached 0\): the client disconnected", lines[0])
    assert m, lines[0]
    assert m[1] == record["id"] and m[1].encode() in data
    assert 3 <= int(m[2]) == record["completion_tokens"] < 200 and int(m[3]) == record["prompt_tokens"]
    # Not logged without --log-requests; a queued request cancelled by the shutdown is logged before it starts.
    with Server(model, port=0, model_name="tiny", source=Slow(200, 0.01)) as s:
        assert s.worker.log is None
    from lily.server.worker import Job, Worker
    from lily.server.prompt import Prompt

    lines = []
    worker = Worker(model, max_context=128, source=Slow(10_000, 0.01))
    worker.log = lines.append
    running, queued = (Job(f"cmpl-{i}", Prompt([1, 2, 3]), lily.SamplingParams(max_tokens=10_000)) for i in "ab")
    worker.submit(running)
    wait_for(lambda: running.first_token is not None)
    worker.submit(queued)
    worker.close()
    assert lines[0] == "request cmpl-b cancelled before it started: the server is shutting down"
    assert re.fullmatch(r"request cmpl-a cancelled after \d+ completion tokens? \(prompt 3, cached 0\): "
                        r"the server is shutting down", lines[1]), lines


def test_server_client_example_has_no_ansi_in_a_pipe():
    source = (ROOT / "examples" / "server_client.py").read_text()
    assert "isatty" in source


# --- conventions ----------------------------------------------------------------------------------

def test_load_shortcut_and_builtin_name():
    with lily.load("tiny", device="cpu") as m:
        assert m.path == tiny_checkpoint()
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"lily {lily.__version__}"


def test_stream_events_split_reasoning_and_carry_speed(model):
    stream = model.stream_generate(USER, max_tokens=12, temperature=0)
    events = list(stream)
    result = stream.result()
    assert result.thinking
    assert "".join(e.reasoning for e in events) == result.reasoning
    assert "".join(e.content for e in events) == result.content
    assert "".join(e.text for e in events) == result.text
    assert events[-1].tokens == 12 and events[-1].tokens_per_second > 0


def test_tool_calls_parsed_in_the_api(model):
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"days": {"type": "integer"}}}}}]
    g = lily.Generation(text="<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
                             "</function>\n</tool_call>", finish_reason="stop", tools=tools)
    (call,) = g.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"days": 3}'}
    assert g.message["tool_calls"] == [call] and g.message["content"] == ""
    assert lily.Generation(text="x").tool_calls == []


def test_logprobs_carry_token_text(model):
    r = model.generate("Hi", max_tokens=2, logprobs=2)
    lp = r.logprobs[0]
    assert lp.token == model.tokenizer.decode([lp.token_id])
    assert lp.top_tokens == [model.tokenizer.decode([i]) for i, _ in lp.top]


def test_chat_takes_a_list_of_conversations_and_defaults_to_generation_config(model, capsys):
    convs = [USER, [{"role": "user", "content": "Bye"}]]
    results = model.chat(convs, max_tokens=3, seed=1, progress=True)
    assert [r.token_ids for r in results] == [model.chat(c, max_tokens=3, seed=1).token_ids for c in convs]
    assert "2/2" in capsys.readouterr().err
    # Default sampling is the checkpoint's, greedy is one keyword away.
    a = model.chat(USER, max_tokens=8, seed=1)
    b = model.chat(USER, params=model.default_sampling(max_tokens=8, seed=1))
    assert a.token_ids == b.token_ids
    assert model.chat(USER, max_tokens=8, temperature=0).token_ids == model.generate(USER, max_tokens=8).token_ids


def test_cli_aliases_and_no_prefix_matching():
    a = run("generate", "-q", "-p", "Hi", "--temp", "0", "-n", "2")
    b = run("generate", "-q", "Hi", "-n", "2")
    assert a.returncode == 0 and a.stdout == b.stdout
    r = run("generate", "--max-tok", "2", "Hi")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


def test_server_ignores_unknown_fields_once(model, capsys):
    from lily.server import parse

    body = {"messages": USER, "reasoning_effort": "low", "user": "u", "metadata": {"a": "b"}}
    req = parse.parse_chat(body, model.default_sampling())
    req = parse.parse_chat(body, model.default_sampling())
    assert req.messages[0]["content"] == "Hi!"
    assert capsys.readouterr().err.count("reasoning_effort") == 1
    with pytest.raises(APIError, match="did you mean 'temperature'"):
        parse.parse_chat({"messages": USER, "temprature": 0.5}, model.default_sampling())


def test_test_extra_has_no_exact_pins():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert not [d for d in extra if "==" in d]


def test_metrics_text(model):
    from lily.server.worker import Job, Worker
    from lily.server.prompt import Prompt

    worker = Worker(model, max_context=128)
    try:
        job = Job("cmpl-1", Prompt([1, 2, 3]), lily.SamplingParams(max_tokens=4))
        worker.submit(job)
        while (item := job.next_item(30)) is not None and item[0] == "event":
            pass
        text = worker.metrics.render(worker)
    finally:
        worker.close()
    assert 'lily_requests_total{outcome="done"} 1' in text and "lily_completion_tokens_total 4" in text
    assert 'lily_time_to_first_token_seconds_bucket{le="+Inf"} 1' in text
    assert "lily_time_to_first_token_seconds_count 1" in text and "lily_queue_waiting 0" in text
