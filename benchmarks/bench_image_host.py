"""Where the time to first token of an image prompt goes besides the tower: each host step of
Model.generate's image path, timed with perf_counter around the library's own functions (issue 17's
TTFT gap: TTFT - encode - the text-only TTFT of the same length).

    python benchmarks/bench_image_host.py [--device cpu] [--megapixels 0.25,1,4] [--rounds 5]

Without --model it writes the tiny text model with the tiny vision tower (the host steps depend on the
image's size, not on the tower: its patches are the real 16 x 16 x 2 frames); on the CPU, whose fp32
tower and prefill dominate the TTFT, --megapixels 0.25,1 takes about a minute. On CUDA pass a checkpoint
with the full tower (bench_vision.py's) to see the device share too.
Each row: one warm-up, then the median of --rounds generate(max_tokens=1) calls of [vision_start, image
pads, vision_end] + a 100-token question on a reset session, as bench_vision.py's TTFT. Stages:
  prepare   model.prepare_images (decode, resize, normalise, patchify, digest; lily.images.prepare_image)
  layout    the (t, h, w) rope positions and image rows (lily.images.prompt_layout)
  encode    Model.encode_images (the pixels up, the tower, the merged tokens down)
  rest      everything else: prompt checks, spans, prefix lookup, the prefill and the first sample
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict

import numpy as np

import lily
import lily.images
from lily.checkpoint import synthetic

START, END = 248053, 248054


def timed(table: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint with a vision tower (default: the tiny model and tower)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--megapixels", default="0.25,1,4")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    path = args.model or synthetic.make_checkpoint(tempfile.mkdtemp(), "tiny", with_tokenizer=False, vision=True)
    model = lily.Model.load(path, device=args.device)
    stages: dict = defaultdict(float)
    lily.images.prepare_image = timed(stages, "prepare", lily.images.prepare_image)
    lily.images.prompt_layout = timed(stages, "layout", lily.images.prompt_layout)
    lily.Model.encode_images = timed(stages, "encode", lily.Model.encode_images)
    question = np.random.default_rng(1).integers(1000, 100000, 100).tolist()
    print(f"{path}: device {model.device}; ms, median of {args.rounds}")
    print("| MP | tokens | TTFT | prepare | layout | encode | rest | text-only TTFT |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mp in (float(x) for x in args.megapixels.split(",")):
        side = int(round((mp * 2**20) ** 0.5 / 32)) * 32
        img = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
        n = (side // 32) ** 2
        ids = [START] + [model.config.image_token_id] * n + [END] + question
        session = model.new_session(max_context=len(ids) + 8)
        rows = defaultdict(list)
        for with_image in (True, False):
            for r in range(args.rounds + 1):
                stages.clear()
                session.reset()
                t0 = time.perf_counter()
                model.generate(ids if with_image else [5] * (n + 2) + question, session=session,
                               images=[img] if with_image else None, max_tokens=1, temperature=0, ignore_eos=True)
                total = time.perf_counter() - t0
                if r == 0:
                    continue  # warm-up
                if with_image:
                    rows["ttft"].append(total)
                    for k in ("prepare", "layout", "encode"):
                        rows[k].append(stages[k])
                    rows["rest"].append(total - sum(stages.values()))
                else:
                    rows["text"].append(total)
        ms = {k: 1e3 * statistics.median(v) for k, v in rows.items()}
        print(f"| {mp} | {n} | {ms['ttft']:.1f} | {ms['prepare']:.1f} | {ms['layout']:.2f} | {ms['encode']:.1f} | "
              f"{ms['rest']:.1f} | {ms['text']:.1f} |")


if __name__ == "__main__":
    main()
