"""The checkpoint's tokenizer and chat template.

``Tokenizer`` wraps the ``tokenizers`` library's byte-level BPE from ``tokenizer.json`` and renders
the checkpoint's Jinja chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``) in a sandbox with the helpers Hugging Face templates use (``raise_exception``,
``tojson``, ``strftime_now``, loop controls, ``{% generation %}`` blocks). Qwen3.5/3.6 add no BOS:
``encode`` returns exactly the ids of the text, with added tokens such as ``<|im_start|>``
recognised wherever they appear.
"""
from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import CheckpointError, LilyError

TEMPLATE_FILE = "chat_template.jinja"
LONG_TEXT_CHARS = 1 << 16  # texts longer than this are encoded without holding the GIL


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode alphabet, inverted: the character each byte is spelled with -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = 0x100
    for b in range(256):
        if b not in chars:
            chars[b] = chr(shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_decoder()


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face's tojson: plain json.dumps, no HTML escaping (unlike Jinja's built-in filter).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


TEMPLATE_SECONDS = 10.0  # a chat template's render budget (a template with runaway loops fails instead of spinning)
TEMPLATE_MAX_CHARS = 64 << 20  # and the most text it may produce
_budget = threading.local()


def _tick() -> None:
    deadline = getattr(_budget, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        from jinja2.exceptions import TemplateRuntimeError

        raise TemplateRuntimeError(f"rendering took more than {TEMPLATE_SECONDS:g} s (a loop that does not end?)")


def _budgeted_range(*args):
    from jinja2.sandbox import safe_range

    for i in safe_range(*args):  # the sandbox's range (at most MAX_RANGE items), checked per item
        _tick()
        yield i


def _render(template, context: dict) -> str:
    """``template.render(**context)`` within TEMPLATE_SECONDS and TEMPLATE_MAX_CHARS."""
    from jinja2.exceptions import TemplateRuntimeError

    _budget.deadline = time.monotonic() + TEMPLATE_SECONDS
    try:
        parts, n = [], 0
        for part in template.generate(**context):
            _tick()
            n += len(part)
            if n > TEMPLATE_MAX_CHARS:
                raise TemplateRuntimeError(f"the rendered prompt exceeds {TEMPLATE_MAX_CHARS} characters")
            parts.append(part)
        return "".join(parts)
    finally:
        _budget.deadline = None


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
        rendering only needs its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with the render budget checked at every call, attribute and item access."""

        def call(self, __context, __obj, *args, **kwargs):
            _tick()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _tick()
            return super().getitem(obj, argument)

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationBlock])
    env.globals["range"] = _budgeted_range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _normalise_messages(messages) -> list[dict]:
    """Validate chat messages; tool-call arguments given as JSON text (OpenAI style) become mappings,
    which is what Qwen's template iterates. The caller's objects are never modified."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise LilyError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise LilyError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        # Which roles exist is the template's business (Qwen: system, user, assistant, tool).
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise LilyError(f"messages[{i}] needs a 'role' string (system, user, assistant, tool), "
                            f"got {m.get('role')!r}")
        m = dict(m)
        if m["role"] == "developer":  # OpenAI's name for the system role (the server maps it too)
            m["role"] = "system"
        m["content"] = _check_content(m, i)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_normalise_tool_call(c, i, j) for j, c in enumerate(calls)]
        out.append(m)
    return out


TEXT_ONLY_ROLES = ("system", "user", "tool")  # roles whose messages need content (assistant: tool_calls may stand in)


def _check_content(m: Mapping, i: int):
    """A message's content, checked as the server checks it: a string, a list of text and image parts
    (text-only lists are joined; with images, the list of ``{"type": "text", "text"}`` and
    ``{"type": "image"}`` parts the template renders, one ``<|image_pad|>`` per image), or (assistant
    messages only) None / missing. Video and audio parts are refused. One rule for the Python API and
    the server; the images themselves are taken out by lily.multimodal.extract_images."""
    from .multimodal import is_image_part, is_video_part

    content = m.get("content")
    if content is None:
        if m["role"] in TEXT_ONLY_ROLES:
            raise LilyError(f"'messages[{i}].content' is required for {m['role']} messages")
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise LilyError(f"'messages[{i}].content': expected a string or a list of text and image parts, "
                        f"got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if is_video_part(part):
            raise LilyError(f"'messages[{i}].content[{j}]': video and audio input are not supported (images only)")
        if is_image_part(part):
            parts.append({"type": "image"})
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            raise LilyError(f"'messages[{i}].content[{j}]': expected a text or image part, "
                            f"got {kind if kind is not None else type(part).__name__!r}")
        if not isinstance(part.get("text"), str):
            raise LilyError(f"'messages[{i}].content[{j}].text' is required (a string) for a text part")
        if parts and "text" in parts[-1]:
            parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
        else:
            parts.append({"type": "text", "text": part["text"]})
    if all("text" in p for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _normalise_tool_call(call, i: int, j: int) -> dict:
    if not isinstance(call, Mapping):
        raise LilyError(f"messages[{i}]['tool_calls'][{j}] must be a dict, got {type(call).__name__}")
    call = dict(call)
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise LilyError(f"messages[{i}]['tool_calls'][{j}] needs a function name "
                        f"({{'function': {{'name': ..., 'arguments': ...}}}})")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise LilyError(f"messages[{i}]['tool_calls'][{j}] arguments are not valid JSON: {e}") from None
        if not isinstance(args, Mapping):
            raise LilyError(f"messages[{i}]['tool_calls'][{j}] arguments must be a JSON object")
        fn = {**fn, "arguments": args}
        if "function" in call:
            call["function"] = fn
        else:
            call = fn
    return call


class Tokenizer:
    """Text <-> token ids for one checkpoint, and its chat template.

    ``encode(text) -> list[int]`` (no BOS, added tokens recognised), ``decode(ids) -> str``,
    ``token_bytes(id) -> bytes`` (for streaming), ``apply_chat_template(messages, ...) -> str`` and
    ``encode_chat(messages, ...) -> list[int]``. ``backend`` is the underlying
    ``tokenizers.Tokenizer``.
    """

    def __init__(self, backend, chat_template: str | None = None, template_vars: Mapping[str, Any] | None = None,
                 name: str = "tokenizer"):
        self.backend = backend
        self.chat_template = chat_template
        self.name = name
        self._template_vars = dict(template_vars or {})
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added = {i: t.content.encode("utf-8") for i, t in added.items()}
        self._bytes: dict[int, bytes] = {}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` and the chat template of a checkpoint folder.

        Raises CheckpointError when tokenizer.json is missing or unreadable; a missing chat template
        is only an error once a chat is rendered."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(f"{file}: not found; this checkpoint has no tokenizer (pass token ids)")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:  # the tokenizers library reports parse errors as plain Exceptions
            raise CheckpointError(f"{file}: not a valid tokenizer.json ({e})") from None
        config = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from None
        template = None
        if (path / TEMPLATE_FILE).is_file():
            template = (path / TEMPLATE_FILE).read_text(encoding="utf-8")
        else:
            template = _template_from_config(config.get("chat_template"), cfg_file)
        # Templates may print these; Hugging Face passes them as strings (None when unset).
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        template_vars = {n: _token_text(config.get(n)) for n in names}
        return cls(backend, template, template_vars, name=str(path))

    # --- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` [T]; no BOS or other ids are added."""
        if not isinstance(text, str):
            raise LilyError(f"text to encode must be a str, got {type(text).__name__}")
        if len(text) > LONG_TEXT_CHARS:  # encode_batch releases the GIL: other threads run meanwhile
            return self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; invalid UTF-8 (a character cut between tokens) becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (its content for added tokens); b"" for ids
        beyond the vocabulary (padding rows of the embedding). Concatenating token_bytes and
        decoding as UTF-8 with replacement equals ``decode``."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._added.get(token_id)
            if b is None:
                piece = self.backend.id_to_token(token_id)
                if piece is None:
                    b = b""
                else:
                    try:
                        b = bytes(_BYTE_OF[c] for c in piece)
                    except KeyError:  # outside the byte alphabet: the ByteLevel decoder keeps it as is
                        b = piece.encode("utf-8")
            self._bytes[token_id] = b
        return b

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
                            add_generation_prompt: bool = True, enable_thinking: bool | None = None,
                            preserve_thinking: bool | None = None, **template_kwargs) -> str:
        """Render a conversation with the checkpoint's template.

        ``messages``: dicts with 'role' (system | user | assistant | tool) and 'content' (str or a
        list of parts); assistant messages may carry 'reasoning_content' and 'tool_calls'
        (arguments as a dict or as JSON text). ``tools``: OpenAI-style function definitions.
        ``enable_thinking`` / ``preserve_thinking``: None leaves the template's default (Qwen3.6:
        thinking on, earlier turns' reasoning dropped). Extra keyword arguments reach the template.
        """
        if self.chat_template is None:
            raise CheckpointError(f"{self.name}: the checkpoint has no chat template (chat_template.jinja "
                                  f"or tokenizer_config.json 'chat_template'); pass text or token ids")
        if tools is not None and (isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence)):
            raise LilyError("tools must be a list of tool definitions ({'type': 'function', 'function': ...})")
        context = {**self._template_vars, **template_kwargs, "messages": _normalise_messages(messages),
                   "tools": list(tools) if tools else None, "add_generation_prompt": add_generation_prompt}
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)
        if preserve_thinking is not None:
            context["preserve_thinking"] = bool(preserve_thinking)
        from jinja2.exceptions import TemplateError

        try:
            return _render(_compile(self.chat_template), context)
        except TemplateError as e:
            raise LilyError(f"chat template: {e}") from None

    def encode_chat(self, messages: Sequence[Mapping], **kwargs) -> list[int]:
        """``encode(apply_chat_template(messages, **kwargs))``."""
        return self.encode(self.apply_chat_template(messages, **kwargs))

    def __repr__(self) -> str:
        return (f"Tokenizer('{self.name}', vocab={self.vocab_size}, special={len(self.special_ids)}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")


def _template_from_config(value, cfg_file: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the 'default'
    one is used)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise CheckpointError(f"{cfg_file}: 'chat_template' must be a string or a list with a 'default' entry")


def _token_text(value) -> str | None:
    # tokenizer_config.json spells special tokens as strings or as AddedToken dicts.
    return value.get("content") if isinstance(value, Mapping) else value
