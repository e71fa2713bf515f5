"""The lily command end to end on synthetic checkpoints."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import lily
from lily.checkpoint.tiny import tiny_checkpoint


def run(*args, cache, stdin=None, timeout=600):
    env = dict(os.environ, LILY_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "lily.cli", *args], capture_output=True, text=True,
                          env=env, input=stdin, timeout=timeout)


@pytest.fixture(scope="module")
def cache():
    """The cache folder holding the built-in tiny checkpoint (shared with the other test modules)."""
    return tiny_checkpoint().parent.parent


@pytest.fixture(scope="module")
def model():
    return lily.Model.load(tiny_checkpoint(), device="cpu")


def test_generate_streams_the_python_api_result(cache, model):
    # No --max-tokens: the built-in tiny checkpoint stops after 32.
    r = run("generate", "Hello, world", "--logprobs", "2", cache=cache)
    assert r.returncode == 0, r.stderr
    assert "prompt tokens: 3" in r.stderr and "[32 tokens, finish_reason=length" in r.stderr
    ids = json.loads(r.stderr.split("generated token ids: ")[1].splitlines()[0])
    expected = model.generate("Hello, world", max_tokens=32)
    assert ids == expected.token_ids
    assert r.stdout == expected.text + "\n"
    assert r.stderr.count("  [") == 32  # one logprob line per token
    q = run("generate", "-q", "--max-tokens", "3", cache=cache, stdin="Hello, world")
    assert q.returncode == 0 and q.stderr == ""
    assert q.stdout == model.generate("Hello, world", max_tokens=3).text + "\n"


def test_generate_sampling_and_chat_flags(cache, model):
    args = ["-q", "--chat", "--system", "Be brief.", "--no-think", "-t", "0.8", "--top-p", "0.9", "--seed", "7",
            "-n", "4", "Hi"]
    r = run("generate", *args, cache=cache)
    assert r.returncode == 0, r.stderr
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = model.chat(messages, temperature=0.8, top_p=0.9, seed=7, max_tokens=4, enable_thinking=False)
    assert r.stdout == expected.text + "\n"


def test_chat_multi_turn_resumes_the_session(cache, model):
    r = run("chat", "-v", "-n", "3", "--temperature", "0", "--hide-thinking", cache=cache,
            stdin="Hi\nAnd again\n/reset\nHi\n/exit\n")
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 3
    messages = [{"role": "user", "content": "Hi"}]
    boundary = len(model.tokenizer.encode_chat(messages, add_generation_prompt=False))
    assert "(0 reused)" in stats[0] and f"({boundary} reused)" in stats[1]
    # After /reset the same first turn starts over and reuses the snapshot of its own prefix.
    assert f"({boundary} reused)" in stats[2]
    # Thinking is hidden and the answers are the greedy ones.
    first = model.chat(messages, max_tokens=3, temperature=0)
    assert r.stdout.startswith("> \n> ")
    assert first.content == ""  # three tokens are all reasoning


def test_jsonl_batch_resumes(cache, model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = ['"Hello, world"', json.dumps({"id": "b", "prompt": "Hello, there"}), "",
            json.dumps({"id": "c", "messages": [{"role": "user", "content": "Hi"}]})]
    prompts.write_text("\n".join(rows) + "\n")
    out = tmp_path / "results.jsonl"
    # An interrupted earlier run: one complete line and half of the next.
    out.write_text(json.dumps({"id": "b", "text": "earlier", "token_ids": [], "finish_reason": "length"})
                   + "\n" + '{"id": 0, "te')
    r = run("generate", "--input", str(prompts), "--output", str(out), "-n", "3", cache=cache)
    assert r.returncode == 0, r.stderr
    assert "3 prompts, 1 already in" in r.stderr and "generate" in r.stderr  # the progress bar
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in lines] == ["b", 0, "c"] and lines[0]["text"] == "earlier"
    assert lines[1]["token_ids"] == model.generate("Hello, world", max_tokens=3).token_ids
    chat = model.chat([{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    assert lines[2]["token_ids"] == chat.token_ids and lines[2]["reasoning"] == chat.reasoning
    assert lines[2]["usage"]["prompt_tokens"] == chat.usage.prompt_tokens
    again = run("generate", "-q", "--input", str(prompts), "--output", str(out), cache=cache)
    assert again.returncode == 0 and len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--top-p", "0"], "top_p must be >= 1e-06"),
    (["generate", "--input", "nope.jsonl", "--output", "x.jsonl"], "nope.jsonl: no such input file"),
    (["generate", "--input", "BAD", "--output", "x.jsonl"], "BAD:1: not valid JSON"),
])
def test_bad_input_is_a_clear_error(cache, tmp_path, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    args = [str(bad) if a == "BAD" else a for a in args]
    message = message.replace("BAD", str(bad))
    r = run(*args, "--model", str(tiny_checkpoint()), "-n", "1", cache=cache, timeout=120)
    assert r.returncode == 2 and "lily: error:" in r.stderr and message in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_model_is_a_clear_error(tmp_path):
    r = run("generate", "hi", "--model", str(tmp_path / "nope" / "x"), cache=tmp_path)
    assert r.returncode == 2
    assert "lily: error:" in r.stderr and "no such folder" in r.stderr
    assert "Traceback" not in r.stderr


def test_help_documents_every_option(cache):
    for command, options in [("generate", ["--temperature", "--top-k", "--top-p", "--min-p", "--presence-penalty",
                                           "--frequency-penalty", "--repetition-penalty", "--seed", "--max-tokens",
                                           "--stop", "--logprobs", "--no-think", "--preserve-thinking", "--system",
                                           "--input", "--output", "--chat", "resume"]),
                             ("chat", ["--hide-thinking", "--no-think", "/reset", "generation_config"])]:
        r = run(command, "--help", cache=cache)
        assert r.returncode == 0
        for option in options:
            assert option in r.stdout, (command, option)


def test_make_checkpoint_loads_and_runs(tmp_path):
    # The MLX layout is what the built-in tiny checkpoint (used above) is made with.
    out = tmp_path / "hf"
    r = run("make-checkpoint", str(out), "--config", "tiny", "--layout", "hf", "--seed", "3", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    model = lily.Model.load(out, device="cpu")
    assert model.layout == "hf"
    assert (out / "chat_template.jinja").is_file()
    logits = model.prefill(model.tokenizer.encode("The quick brown fox"))
    assert np.isfinite(logits).all() and logits.std() > 0.5


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    from lily.checkpoint import synthetic

    return synthetic.make_checkpoint(tmp_path_factory.mktemp("hf"), "tiny", layout="hf", with_tokenizer=False)


def test_convert_writes_what_the_converter_writes(hf_tiny, tmp_path):
    from lily.checkpoint import convert

    out = tmp_path / "mlx"
    r = run("convert", str(hf_tiny), str(out), cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "4-bit, group 64" in r.stdout and "converting" in r.stderr  # summary, progress bar
    ref = convert.convert_hf_to_mlx(hf_tiny, tmp_path / "ref")
    files = sorted(f.name for f in ref.iterdir())
    assert sorted(f.name for f in out.iterdir()) == files
    for name in files:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    model = lily.Model.load(out, device="cpu")
    assert model.layout == "mlx" and np.isfinite(model.prefill([1, 2, 3])).all()


def test_convert_keeps_a_non_empty_output_unless_told(hf_tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = run("convert", str(hf_tiny), str(out), cache=tmp_path)
    assert r.returncode == 2 and "not empty" in r.stderr and "--overwrite" in r.stderr
    assert "Traceback" not in r.stderr and [f.name for f in out.iterdir()] == ["notes.txt"]
    r = run("convert", str(hf_tiny), str(out), "--bits", "8", "--overwrite", "--quiet", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "8-bit" in r.stdout and (out / "notes.txt").read_text() == "mine"
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8


@pytest.mark.parametrize("args, message", [
    (["--bits", "3"], "invalid choice: 3"),
    (["--group-size", "48"], "invalid choice: 48"),
    (["--workers", "0"], "--workers must be >= 1"),
])
def test_convert_bad_arguments_are_clear_errors(hf_tiny, tmp_path, args, message):
    r = run("convert", str(hf_tiny), str(tmp_path / "out"), *args, cache=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_convert_missing_source_is_a_clear_error(tmp_path):
    r = run("convert", str(tmp_path / "nope"), str(tmp_path / "out"), cache=tmp_path)
    assert r.returncode == 2 and "no such folder" in r.stderr and "Traceback" not in r.stderr


# --- issue 14 row 12: --output at a file that is not lily's -------------------------------------------

@pytest.mark.parametrize("content", [b"my notes\nlast line without newline", b"\xff\xfe binary \x00\n", b'{"id": [1]}\n'])
def test_output_that_is_not_a_lily_file_is_left_untouched(tmp_path, content):
    from lily.cli import completed_ids

    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    with pytest.raises(lily.LilyError, match="not a lily result"):
        completed_ids(out)
    assert out.read_bytes() == content


def test_a_cut_short_lily_line_is_still_removed(tmp_path):
    from lily.cli import completed_ids

    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": 1, "text": "a"}\n{"id": 2, "te')
    assert completed_ids(out) == {1}
    assert out.read_bytes() == b'{"id": 1, "text": "a"}\n'


@pytest.mark.parametrize("line, match", [('{"id": [1], "prompt": "x"}', "'id' must be a string or an integer"),
                                         (None, "not UTF-8")])
def test_bad_input_files_are_lily_errors(tmp_path, line, match):
    from lily.cli import read_prompts

    src = tmp_path / "in.jsonl"
    src.write_bytes(line.encode() + b"\n" if line else b"\xff\xfe\n")
    with pytest.raises(lily.LilyError, match=match):
        read_prompts(src)
