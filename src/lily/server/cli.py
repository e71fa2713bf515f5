"""``lily serve``: the OpenAI-compatible server on the command line."""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ..errors import LilyError
from ..multimodal import DEFAULT_FETCH_SECONDS, DEFAULT_MAX_IMAGE_BYTES, URLPolicy
from .worker import DEFAULT_CACHE_MIB, DEFAULT_MAX_QUEUE

# As app.MAX_CONNECTIONS / REQUEST_TIMEOUT / KEEPALIVE_TIMEOUT (not imported: uvicorn and Starlette load slowly).
MAX_CONNECTIONS, REQUEST_TIMEOUT, KEEPALIVE_TIMEOUT = 256, 30.0, 15.0

TINY_NAME = "lily-tiny"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``lily serve`` on the sub-command parsers of ``lily.cli.build_parser``."""
    from ..cli_common import add_model_arguments

    p = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve one model over HTTP: POST /v1/chat/completions, POST /v1/completions (both with "
                    "stream), GET /v1/models, GET /health, GET /openapi.json. One request runs at a time; "
                    "others wait in a FIFO queue (429 when it is full). Multi-turn chats resume from "
                    "snapshots at message boundaries. See docs/server.md.",
        epilog="examples:\n"
               "  lily serve -m mlx-community/Qwen3.6-35B-A3B-4bit\n"
               "  lily serve -m CKPT --port 8080 --api-key SECRET --max-context 32768\n\n"
               "client:\n"
               "  from openai import OpenAI\n"
               "  client = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='SECRET')\n"
               "  r = client.chat.completions.create(model='CKPT', messages=[{'role': 'user', 'content': 'Hi'}])")
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="checkpoint folder or Hugging Face repo id (the same as --model)")
    add_model_arguments(p, quiet_help="no load progress and no start or stop lines on stderr")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $LILY_API_KEY; unset = no key). "
                        "A key on the command line is visible to other users in `ps`: prefer $LILY_API_KEY or "
                        "--api-key-file")
    p.add_argument("--api-key-file", metavar="PATH", default=None,
                   help="read the API key from the first line of this file")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help=f"open connections at once; more are answered 503 (default {MAX_CONNECTIONS})")
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT, metavar="S",
                   help=f"seconds to receive a request's headers and body (default {REQUEST_TIMEOUT:g})")
    p.add_argument("--keepalive-timeout", type=float, default=KEEPALIVE_TIMEOUT, metavar="S",
                   help=f"seconds an idle connection (new, or between requests) is kept open "
                        f"(default {KEEPALIVE_TIMEOUT:g})")
    p.add_argument("--served-model-name", metavar="NAME",
                   help=f"the model id clients send and /v1/models lists (default: the --model value, or "
                        f"'{TINY_NAME}' for the built-in tiny checkpoint)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait while one runs; more get 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--prefix-cache-mib", type=int, default=DEFAULT_CACHE_MIB, metavar="MIB",
                   help=f"memory for prefix snapshots reused across requests, in MiB (default {DEFAULT_CACHE_MIB}; "
                        f"0 turns the cache off)")
    p.add_argument("--allow-control-tokens", action="store_true",
                   help="accept special-token text such as <|im_start|> in chat messages (default: 400)")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="let image_url parts name http(s) URLs, which the server then fetches (off: data: URLs "
                        "only); each image at most --image-max-mib, fetched within --image-fetch-timeout")
    p.add_argument("--allow-image-dir", metavar="DIR", type=Path, default=None,
                   help="let image_url parts name file:// URLs of files under DIR (off: local files are refused)")
    p.add_argument("--image-max-mib", type=float, default=DEFAULT_MAX_IMAGE_BYTES / 2**20, metavar="MIB",
                   help=f"the largest encoded image a request may send or name (default {DEFAULT_MAX_IMAGE_BYTES >> 20})")
    p.add_argument("--image-fetch-timeout", type=float, default=DEFAULT_FETCH_SECONDS, metavar="S",
                   help=f"with --allow-image-urls: the seconds one image may take to download "
                        f"(default {DEFAULT_FETCH_SECONDS:g})")
    p.add_argument("--image-min-pixels", type=int, default=None, metavar="N",
                   help="the fewest pixels an image is resized to (default: the checkpoint's preprocessor_config.json; "
                        "a request's mm_processor_kwargs.min_pixels wins)")
    p.add_argument("--image-max-pixels", type=int, default=None, metavar="N",
                   help="the most pixels an image is resized to, which bounds its prompt tokens (one per 32 x 32 "
                        "pixels; default: the checkpoint's; a request's mm_processor_kwargs.max_pixels wins)")
    p.add_argument("--log-requests", action="store_true", help="print one line per HTTP request to stderr")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from ..checkpoint.hub import BUILTIN_NAMES
    from ..cli_common import load_model
    from .app import Server

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise LilyError(f"give the model once: MODEL ({args.model_arg}) or --model ({args.model}), not both")
        args.model = args.model_arg
    if not 0 <= args.port <= 65535:
        raise LilyError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 1:
        raise LilyError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.prefix_cache_mib < 0:
        raise LilyError(f"--prefix-cache-mib must be >= 0, got {args.prefix_cache_mib}")
    if args.max_context is not None and args.max_context < 2:
        raise LilyError(f"--max-context must be >= 2, got {args.max_context}")
    if args.max_connections < 1:
        raise LilyError(f"--max-connections must be >= 1, got {args.max_connections}")
    policy = image_policy(args)
    if not args.request_timeout > 0:
        raise LilyError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if not args.keepalive_timeout > 0:
        raise LilyError(f"--keepalive-timeout must be > 0, got {args.keepalive_timeout}")
    api_key = read_api_key(args.api_key, args.api_key_file)
    model = load_model(args)
    pixels = image_pixels(args, model)
    name = args.served_model_name or args.model or TINY_NAME
    # Besides the served name, requests may name the model as --model gave it, by its folder, or
    # (the built-in model) by the names Model.load takes for it.
    aliases = {str(args.model), str(model.path), model.path.name} - {"None"}
    if args.model is None or args.model in BUILTIN_NAMES:
        aliases |= set(BUILTIN_NAMES)
    aliases = tuple(sorted(aliases))
    try:
        server = Server(model, host=args.host, port=args.port, api_key=api_key, model_name=name, aliases=aliases,
                        max_queue=args.max_queue, cache_mib=args.prefix_cache_mib, log=args.log_requests,
                        max_connections=args.max_connections, request_timeout=args.request_timeout,
                        keepalive_timeout=args.keepalive_timeout,
                        allow_control_tokens=args.allow_control_tokens, image_policy=policy, image_pixels=pixels)
    except OSError as e:
        raise LilyError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    if args.host not in LOOPBACK and api_key is None:
        print(f"lily serve: warning: listening on {args.host} without an API key", file=sys.stderr)
    if not args.quiet:
        print(f"lily serve: '{name}' on {server.url}/v1 (context {server.worker.max_context} tokens, queue "
              f"{args.max_queue}, prefix cache {args.prefix_cache_mib} MiB{', API key required' if api_key else ''}); "
              f"Ctrl-C stops", file=sys.stderr, flush=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()  # running streams end with the error event and [DONE] first
        model.close()
    if not args.quiet:
        print("lily serve: stopped", file=sys.stderr)
    return 0


def image_pixels(args: argparse.Namespace, model) -> tuple[int | None, int | None]:
    """The --image-min-pixels / --image-max-pixels bounds, checked against the model's image settings."""
    pixels = (args.image_min_pixels, args.image_max_pixels)
    if pixels == (None, None):
        return pixels
    if model.config.vision is None:
        raise LilyError(f"--image-min-pixels / --image-max-pixels: {model.path.name} has no vision tower")
    try:
        model.image_processor.with_pixels(*pixels)
    except LilyError as e:
        raise LilyError(f"--image-min-pixels / --image-max-pixels: {e}") from None
    return pixels


def image_policy(args: argparse.Namespace) -> URLPolicy:
    """The image URLs requests may use, from the --allow-image-* flags (checked)."""
    if args.image_max_mib <= 0 or args.image_fetch_timeout <= 0:
        raise LilyError("--image-max-mib and --image-fetch-timeout must be positive")
    folder = args.allow_image_dir
    if folder is not None and not folder.expanduser().is_dir():
        raise LilyError(f"--allow-image-dir {folder}: not a directory")
    return URLPolicy(allow_http=args.allow_image_urls, allowed_dir=folder.expanduser() if folder else None,
                     max_bytes=int(args.image_max_mib * 2**20), timeout=args.image_fetch_timeout)


def read_api_key(given: str | None, path: str | None) -> str | None:
    """The key from --api-key, else --api-key-file, else $LILY_API_KEY; an empty one is an error
    (it would silently turn authentication off)."""
    import os

    if given is not None and path is not None:
        raise LilyError("give --api-key or --api-key-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                given = f.readline(4096).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise LilyError(f"--api-key-file {path}: {e}") from None
    elif given is None:
        given = os.environ.get("LILY_API_KEY")
    if given is not None and not given.strip():
        raise LilyError("the API key is empty: give a non-empty key, or none to serve without one")
    return given


def _interrupt(signum, frame):
    raise KeyboardInterrupt
