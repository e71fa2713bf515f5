"""The ``lily`` command: generate, chat, make-checkpoint.

Without ``--model``, ``generate`` and ``chat`` run the tiny built-in synthetic checkpoint (random
weights, real Qwen3.6 tokenizer and chat template), made once and cached, so a fresh install can run
end to end offline.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .cli_common import add_model_arguments, load_model
from .errors import LilyError

SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "max_tokens", "stop", "ignore_eos", "logprobs")
DIM, RESET = "\033[2m", "\033[0m"


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampling flags given on the command line, checked (LilyError) before the slow load."""
    from .sampling import SamplingParams

    given = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    if getattr(args, "greedy", False):
        if given.get("temperature", 0) != 0:
            raise LilyError("--greedy and --temperature contradict each other; give one")
        given["temperature"] = 0.0
    SamplingParams(**given)
    return given


def template_kwargs(args: argparse.Namespace) -> dict:
    return {"enable_thinking": False if args.no_think else None,
            "preserve_thinking": True if args.preserve_thinking else None}


class ThinkPrinter:
    """Streams a chat answer to a terminal: the reasoning (up to ``</think>``) dimmed or hidden."""

    def __init__(self, out, thinking: bool, show_reasoning: bool):
        self.out, self.in_think, self.show = out, thinking, show_reasoning
        self.color = out.isatty()
        self.skip_newlines = False

    def write(self, text: str) -> None:
        if self.in_think:
            head, sep, tail = text.partition("</think>")
            if self.show and head:
                self.out.write(f"{DIM}{head}{RESET}" if self.color else head)
            if not sep:
                return
            self.in_think, self.skip_newlines = False, True
            if self.show:
                self.out.write("\n")
            text = tail
        if self.skip_newlines:
            text = text.lstrip("\n")
            self.skip_newlines = not text
        self.out.write(text)
        self.out.flush()


def check_generate_flags(args: argparse.Namespace) -> None:
    """Refuse flags that would otherwise be ignored (before the model loads)."""
    if args.prompt_opt is not None:
        if args.prompt is not None:
            raise LilyError("give the prompt once: as an argument or with --prompt/-p, not both")
        args.prompt = args.prompt_opt
    if args.output and not args.input:
        raise LilyError("--output is where --input writes its results; give --input PROMPTS.jsonl too "
                        "(without --input the text goes to stdout)")
    if args.input and args.prompt is not None:
        raise LilyError("give a prompt or --input PROMPTS.jsonl, not both")
    if not args.chat and not args.input:
        for flag, given in (("--system", args.system is not None), ("--no-think", args.no_think),
                            ("--preserve-thinking", args.preserve_thinking)):
            if given:
                raise LilyError(f"{flag} applies to chat prompts: add --chat (the prompt is sent as a user "
                                f"message through the chat template)")
    if args.greedy and not args.chat:
        raise LilyError("--greedy applies to --chat (plain generate is already greedy)")
    if args.image and (args.input or not args.chat):
        raise LilyError("--image applies to a --chat prompt (the images go before the text in the user message); "
                        "with --input, put image parts in each line's messages")
    if not args.image and (args.image_min_pixels is not None or args.image_max_pixels is not None):
        raise LilyError("--image-min-pixels / --image-max-pixels apply to --image")


def add_image_pixel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-min-pixels", type=int, metavar="N",
                   help="images are resized to at least N pixels (default: the checkpoint's preprocessor_config.json)")
    p.add_argument("--image-max-pixels", type=int, metavar="N",
                   help="images are resized to at most N pixels, which bounds their prompt tokens (one per 32 x 32 "
                        "pixels; default: the checkpoint's)")


def image_sources(model, args: argparse.Namespace, paths: list[str]) -> list:
    """Image paths as message parts take them: unchanged, or prepared with --image-min/max-pixels."""
    if args.image_min_pixels is None and args.image_max_pixels is None:
        return paths
    return model.prepare_images(paths, min_pixels=args.image_min_pixels, max_pixels=args.image_max_pixels)


def generate_params(args: argparse.Namespace, model=None):
    """generate's sampling: greedy for raw text; with --chat the checkpoint's generation_config
    (as `lily chat` and `lily serve`), --greedy for argmax. Flags override single values."""
    from .sampling import SamplingParams

    overrides = sampling_overrides(args)
    if args.chat and model is not None:
        return model.default_sampling(**overrides)
    return SamplingParams(**overrides)


def chat_prompt(args: argparse.Namespace, prompt):
    """A text prompt as a conversation (--chat), with --system first; a conversation gets --system
    first unless it has a system message of its own."""
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    if isinstance(prompt, str):
        images = getattr(args, "image", None)
        content = [*({"type": "image", "image": path} for path in images), {"type": "text", "text": prompt}] \
            if images else prompt
        return system + [{"role": "user", "content": content}] if args.chat else prompt
    if system and not (prompt and isinstance(prompt[0], dict) and prompt[0].get("role") in ("system", "developer")):
        return system + list(prompt)
    return prompt


def cmd_generate(args: argparse.Namespace) -> int:
    check_generate_flags(args)
    generate_params(args)  # flags checked before the slow load
    if args.input:
        return generate_jsonl(args)
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    model = load_model(args)
    params = generate_params(args, model)
    args.image = image_sources(model, args, args.image)
    prompt = chat_prompt(args, text)
    stream = model.generate(prompt, params, stream=True, **template_kwargs(args))
    printer = ThinkPrinter(sys.stdout, stream.thinking, True)
    for event in stream:
        printer.write(event.text)
    result = stream.result()
    print()
    if not args.quiet:
        u = result.usage
        print(f"prompt tokens: {u.prompt_tokens}\ngenerated token ids: {result.token_ids}", file=sys.stderr)
    if result.logprobs is not None:  # asked for explicitly, so printed with -q too
        for lp in result.logprobs:
            alts = " ".join(f"{i}:{t!r}:{v:.3f}" for (i, v), t in zip(lp.top, lp.top_tokens))
            print(f"  {lp.token_id} {lp.token!r}: {lp.logprob:.3f}  [{alts}]", file=sys.stderr)
    if not args.quiet:
        u = result.usage
        print(f"[{u.completion_tokens} tokens, finish_reason={result.finish_reason}, prefill "
              f"{u.prefill_seconds * 1e3:.1f} ms, decode {u.decode_tokens_per_second:.1f} tok/s]", file=sys.stderr)
    return 0


def generate_jsonl(args: argparse.Namespace) -> int:
    """Each input line is a JSON string (the prompt) or an object with 'prompt' (text) or 'messages'
    (a conversation) and an optional 'id' (default: the line's index among non-empty lines). One
    result line per prompt, written as soon as it is done; prompts whose id is already in the
    output file are skipped, so an interrupted run continues where it stopped."""
    from tqdm.auto import tqdm

    if not args.output:
        raise LilyError("--input needs --output (a .jsonl file for the results)")
    prompts = read_prompts(Path(args.input))
    out_path = Path(args.output)
    done = completed_ids(out_path)
    todo = [(pid, p) for pid, p in prompts if pid not in done]
    if not args.quiet:
        print(f"lily: {len(prompts)} prompts, {len(prompts) - len(todo)} already in {out_path}", file=sys.stderr)
    if not todo:
        return 0
    model = load_model(args)
    params = generate_params(args, model)
    results = model.generate([chat_prompt(args, p) for _, p in todo], params, stream=True, progress=False,
                             **template_kwargs(args))
    with open(out_path, "a", encoding="utf-8") as out, \
            tqdm(total=len(todo), desc="generate", unit="prompt", disable=args.quiet, file=sys.stderr) as bar:
        for (pid, _), r in zip(todo, results):
            row = {"id": pid, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                   "usage": {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                             "cached_tokens": r.usage.cached_tokens}}
            if r.thinking:
                row.update(reasoning=r.reasoning, content=r.content)
            if r.logprobs is not None:
                row["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top}
                                   for lp in r.logprobs]
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
            bar.update(1)
    return 0


def read_prompts(path: Path) -> list[tuple[object, object]]:
    if not path.is_file():
        raise LilyError(f"{path}: no such input file")
    items, seen = [], set()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LilyError(f"{path}: not UTF-8 text ({e})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise LilyError(f"{path}:{lineno}: not valid JSON ({e})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise LilyError(f"{path}:{lineno}: expected a JSON string or an object with 'prompt' or 'messages'")
        pid = item.get("id")
        if "id" in item:
            if isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise LilyError(f"{path}:{lineno}: 'id' must be a string or an integer, got {json.dumps(pid)[:60]}")
            if pid in seen:
                raise LilyError(f"{path}:{lineno}: duplicate id {pid!r}")
            seen.add(pid)
        items.append(("id" in item, pid, item.get("prompt", item.get("messages"))))
    # A line without an id gets its index among the non-empty lines, or the next integer that no line
    # uses as its explicit id (so automatic ids never collide with explicit ones, and are the same
    # every time the same file is read, which resuming needs).
    prompts, auto = [], 0
    for index, (explicit, pid, prompt) in enumerate(items):
        if not explicit:
            auto = max(auto, index)
            while auto in seen:
                auto += 1
            pid = auto
            seen.add(pid)
        prompts.append((pid, prompt))
    return prompts


def completed_ids(path: Path) -> set:
    """Ids already in the output file; a last line cut short by an interruption is removed."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    done = set()
    try:
        lines = data[:end].decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise LilyError(f"{path}: not a lily results file (not UTF-8); use another --output file") from None
    for lineno, line in enumerate(lines, 1):  # every complete line is checked before anything is changed
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LilyError(f"{path}:{lineno}: not a lily result line; use another --output file") from None
    if end < len(data):  # only a cut-short lily line (as an interrupted run leaves) is removed
        if not data[end:].startswith(b'{"id": '):
            raise LilyError(f"{path}:{len(lines) + 1}: not a lily result line; use another --output file")
        with open(path, "r+b") as f:
            f.truncate(end)
    return done


def cmd_chat(args: argparse.Namespace) -> int:
    if args.logprobs is not None:
        raise LilyError("--logprobs is not shown by 'lily chat'; use 'lily generate --chat --logprobs N' "
                        "(or logprobs= in the Python API)")
    overrides = sampling_overrides(args)
    model = load_model(args)
    params = model.default_sampling(**overrides)
    kwargs = template_kwargs(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    session = model.new_session()
    images: list = []  # /image PATH (a path, or prepared with --image-*-pixels): for the next message
    if not args.quiet:
        print("lily chat: /image PATH attaches an image to the next message, /reset starts over, /exit (or Ctrl-D) "
              "quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages, images = list(system), []
            continue
        if line.startswith("/image "):
            path = Path(line[len("/image "):].strip()).expanduser()
            if not path.is_file():
                print(f"[no such file: {path}]", file=sys.stderr)
                continue
            try:
                images += image_sources(model, args, [str(path)])
            except LilyError as e:  # unreadable, or bounds the checkpoint's settings refuse
                print(f"[{path.name} not attached: {e}]", file=sys.stderr)
                continue
            print(f"[{path.name} attached to the next message]", file=sys.stderr)
            continue
        content = [*({"type": "image", "image": p} for p in images), {"type": "text", "text": line}] if images else line
        messages.append({"role": "user", "content": content})
        try:
            stream = model.chat(messages, params, stream=True, session=session, **kwargs)
        except LilyError as e:  # e.g. an unreadable image, or a checkpoint without a vision tower
            messages.pop()
            print(f"[error: {e}]", file=sys.stderr)
            continue
        images = []
        printer = ThinkPrinter(sys.stdout, stream.thinking, not args.hide_thinking)
        try:
            for event in stream:
                printer.write(event.text)
        except KeyboardInterrupt:
            stream.close()
            messages.pop()
            print("\n[interrupted]")
            continue
        result = stream.result()
        print()
        messages.append(result.message)
        if args.verbose:
            u = result.usage
            print(f"[{u.prompt_tokens} prompt tokens ({u.cached_tokens} reused), {u.completion_tokens} generated, "
                  f"finish_reason={result.finish_reason}, prefill {u.prefill_seconds * 1e3:.1f} ms, "
                  f"decode {u.decode_tokens_per_second:.1f} tok/s]", file=sys.stderr)


def add_sampling_arguments(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_argument_group("sampling", f"Default: {default}. A flag given here overrides that one value.")
    g.add_argument("--temperature", "--temp", "-t", type=float, help="0 = greedy; higher = more random")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 or -1 = off)")
    g.add_argument("--top-p", type=float, help="keep the most likely tokens up to this probability mass (1 = off)")
    g.add_argument("--min-p", type=float, help="keep tokens with p >= min_p * p_max (0 = off)")
    g.add_argument("--presence-penalty", type=float, help="subtract from the logit of every token generated so far")
    g.add_argument("--frequency-penalty", type=float, help="subtract per occurrence of a token generated so far")
    g.add_argument("--repetition-penalty", type=float,
                   help="divide positive / multiply negative logits of prompt and output tokens (1 = off)")
    g.add_argument("--seed", type=int, help="random seed; the same seed and prompt give the same text (default random)")
    g.add_argument("--max-tokens", "-n", type=int,
                   help="the most tokens to generate (default: generation_config.json's max_new_tokens, else "
                        "32768, capped by the context; 32 for synthetic checkpoints such as the built-in one)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop when this text appears (not printed); repeat for several")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's end-of-turn tokens")
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="report each token's logprob and the N most likely alternatives (generate only)")


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chat template")
    g.add_argument("--system", "--system-prompt", help="system message")
    g.add_argument("--no-think", action="store_true",
                   help="disable thinking (enable_thinking=false; Qwen3.6 thinks by default)")
    g.add_argument("--preserve-thinking", action="store_true",
                   help="keep the reasoning of earlier turns in the history (preserve_thinking=true)")


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__
    from .checkpoint import convert, synthetic

    p = argparse.ArgumentParser(prog="lily", description="Batch-1 inference for Qwen3.5/3.6 MoE checkpoints.",
                                epilog="Run 'lily COMMAND --help' for each command's options.", allow_abbrev=False)
    p.add_argument("--version", "-V", action="version", version=f"lily {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate", help="generate from a prompt (argument, stdin, or a JSONL file), streaming the text",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text from a prompt, printed as it is generated. Statistics go to stderr.",
        epilog="examples:\n"
               "  lily generate 'Hello, world'                       # tiny built-in model\n"
               "  echo 'Why is the sky blue?' | lily generate -m CKPT --chat --no-think -t 0.7\n"
               "  lily generate -m CKPT --input prompts.jsonl --output results.jsonl\n\n"
               "JSONL input: one prompt per line, a JSON string or {\"id\": ..., \"prompt\": TEXT} or\n"
               "{\"id\": ..., \"messages\": [...]}. Output: one JSON object per prompt (id, text, token_ids,\n"
               "finish_reason, usage, and reasoning/content for thinking chats), written as each one\n"
               "finishes. Rerunning with the same --output skips the ids already there (resume).")
    g.add_argument("prompt", nargs="?", help="prompt text (read from stdin when omitted)")
    g.add_argument("--prompt", "-p", dest="prompt_opt", metavar="TEXT", help="the prompt, as a flag (mlx-lm style)")
    add_model_arguments(g)
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the chat template (default: raw text), "
                        "sampled as generation_config.json recommends (Qwen3.6: temperature 1.0, top_k 20, "
                        "top_p 0.95); with --input, text prompts become user messages")
    g.add_argument("--greedy", action="store_true", help="with --chat: greedy decoding (temperature 0)")
    g.add_argument("--image", action="append", metavar="PATH", default=[],
                   help="with --chat: an image for the user message, before the text (repeatable; "
                        "docs/vision.md)")
    add_image_pixel_arguments(g)
    g.add_argument("--input", "-i", metavar="PROMPTS.jsonl", help="generate for every prompt of a JSONL file")
    g.add_argument("--output", "-o", metavar="RESULTS.jsonl", help="where --input writes results (appended; resumable)")
    add_sampling_arguments(g, "greedy; with --chat the checkpoint's generation_config.json")
    add_chat_arguments(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat", help="interactive multi-turn chat",
        description="Interactive chat with the checkpoint's chat template. Each turn resumes the session, so only "
                    "the new tokens are prefilled. The reasoning is shown dimmed. Commands: /reset, /exit.")
    add_model_arguments(c)
    c.add_argument("--hide-thinking", action="store_true", help="do not print the reasoning")
    c.add_argument("--verbose", "-v", action="store_true", help="print token counts and speed after each answer")
    add_sampling_arguments(c, "the checkpoint's generation_config.json (Qwen3.6: temperature 1.0, top_k 20, "
                              "top_p 0.95)")
    add_chat_arguments(c)
    add_image_pixel_arguments(c)
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("convert", help="convert a Hugging Face bf16 checkpoint to the MLX 4/8-bit layout",
                       description="Convert a Hugging Face checkpoint (bf16 or fp32, model_type qwen3_5_moe) into "
                                   "the MLX layout lily and mlx-lm load: matrices quantized to 4 or 8 bits (the "
                                   "router and shared-expert gates always 8), tokenizer and generation files "
                                   "copied. Shows progress; refuses a non-empty output folder unless --overwrite.")
    convert.add_cli_arguments(v)
    v.set_defaults(func=convert.run_cli)

    m = sub.add_parser("make-checkpoint", help="write a random synthetic checkpoint",
                       description="Write a random checkpoint of any config, MLX 4-bit or Hugging Face bf16 layout.")
    synthetic.add_cli_arguments(m)
    m.set_defaults(func=synthetic.run_cli)

    from .server.cli import add_parser as add_serve_parser

    add_serve_parser(sub)

    from .bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    # Options are matched exactly: the aliases are the documented ones (--temp, --system-prompt, -p),
    # not whatever prefix argparse would accept.
    for parser in sub.choices.values():
        parser.allow_abbrev = False
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LilyError as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
