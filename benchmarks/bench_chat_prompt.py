"""Host cost of turning a chat request into prompt token ids (issue 15, item 8): the steps the server
runs before the engine, on a follow-up turn of a long conversation.

The conversation is shaped like benchmarks/server_ttft.py's follow-up case: a first user message of
--history-tokens tokens, a supplied assistant reply and a new user message of --new-tokens words
(different each repetition). The steps are timed one by one (median of --repeat runs, after one
untimed run that fills the server's caches as the first turn of the conversation would):

  json       json.loads of the request body
  parse      lily.server.parse.parse_chat (validation)
  control    the control-token check of the message text
  render     one chat template render (with the generation prompt)
  encode     tokenizer.encode of that rendering, one shot
  one-shot   lily.server.prompt.chat_prompt without a SegmentEncoder (every rendering encoded whole)
  prompt     chat_prompt with the server's SegmentEncoder (render, token ids, boundaries): what the
             server runs; the first turn's pieces are cached, so only the new messages are encoded

    python benchmarks/bench_chat_prompt.py [--history-tokens 7000] [--new-tokens 150] [--repeat 20]
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time

from lily.checkpoint.tiny import tiny_checkpoint
from lily.sampling import SamplingParams
from lily.server.parse import parse_chat
from lily.server.prompt import SegmentEncoder, chat_prompt
from lily.tokenizer import Tokenizer

WORDS = "the of and to in is that for it as was with be by on not he this are or his from at".split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history-tokens", type=int, default=7000)
    ap.add_argument("--new-tokens", type=int, default=150)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(tiny_checkpoint())
    rng = random.Random(0)
    history = [{"role": "user", "content": "Read this. " + " ".join(rng.choice(WORDS) for _ in range(args.history_tokens))}]

    def body(i: int) -> bytes:
        r = random.Random(i)
        new = " ".join(r.choice(WORDS) for _ in range(args.new_tokens))
        return json.dumps({"messages": history + [{"role": "assistant", "content": "Understood."},
                                                  {"role": "user", "content": new}], "stream": True}).encode()

    specials = sorted({t for t in map(tok.id_to_token, tok.special_ids) if t}, key=len, reverse=True)
    control = re.compile("|".join(map(re.escape, specials)))  # as lily.server.app.Server builds it
    defaults = SamplingParams()
    times: dict[str, list[float]] = {k: [] for k in ("json", "parse", "control", "render", "encode", "one-shot", "prompt")}
    encoder = SegmentEncoder(tok)
    chat_prompt(tok, history, None, {}, 16384, encoder)  # the first turn, as the server saw it
    for i in range(args.repeat):
        raw = body(i)
        t0 = time.perf_counter(); obj = json.loads(raw)
        t1 = time.perf_counter(); req = parse_chat(obj, defaults)
        t2 = time.perf_counter()
        if control is not None:
            for m in req.messages:
                control.search(m.get("content") or "")
        t3 = time.perf_counter(); text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
        t4 = time.perf_counter(); ids = tok.encode(text)
        t5 = time.perf_counter(); p0 = chat_prompt(tok, req.messages, None, {}, 16384)
        t6 = time.perf_counter(); p = chat_prompt(tok, req.messages, None, {}, 16384, encoder)
        t7 = time.perf_counter()
        assert p.ids == p0.ids == ids and p.boundaries == p0.boundaries
        for k, a, b in zip(times, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7)):
            times[k].append((b - a) * 1e3)
    print(f"prompt tokens: {len(ids)}, boundaries: {p.boundaries}")
    print("| step | median ms |\n|---|---:|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v):.3f} |")


if __name__ == "__main__":
    main()
