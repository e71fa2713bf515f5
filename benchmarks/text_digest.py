"""A digest of a text-only run's exact bits, to compare two builds of lily on the same checkpoint (ab_host.sh runs
it with both): the logits of a prefill in several chunks and of decode steps through the captured graph, and the
graph's node count. Equal digests mean the builds compute the text path bit for bit alike.

    python benchmarks/text_digest.py --model PATH [--device cuda] [--tokens 300] [--steps 16]

Uses only API that every build since the decode graph has (Model.load, Session.prefill / decode_step), so an
older build can run this file.
"""
from __future__ import annotations

import argparse
import hashlib

import numpy as np

import lily


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    m = lily.Model.load(args.model, device=args.device, prefill_chunk=128)
    V = m.config.vocab_size
    ids = ((np.arange(args.tokens, dtype=np.int64) * 2654435761) % 2**32 % V).astype(np.int32)
    s = m.new_session(max_context=args.tokens + args.steps + 8)
    h = hashlib.sha256(np.ascontiguousarray(s.prefill(ids, all_logits=True)).tobytes())
    logits = None
    for i in range(args.steps):
        logits = s.decode_step(int(np.argmax(logits)) if logits is not None else int(ids[-1]))
        h.update(np.ascontiguousarray(logits).tobytes())
    print(f"text digest {h.hexdigest()[:32]} graph nodes {s._core.decode_graph_nodes} ({args.model})")


if __name__ == "__main__":
    main()
