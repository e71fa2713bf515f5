"""Image input on one device: the vision tower's encoding time per image size, its per-op profile, and the time
to first token of an image + a 100-token question (issue 17's target: a 1-megapixel image encoded in <= 30 ms
on the H200; docs/perf-notes.md has the prediction).

    python benchmarks/bench_vision.py [--model PATH] [--device cuda] [--megapixels 0.25,1,4] [--json out.json]

Without --model it writes a checkpoint of the tiny text model with the full-size tower (27 blocks, 1152 wide,
16 heads of 72, bf16; the merger's output is the tiny model's 128 wide instead of 2048: 0.5% less work) to a
temporary folder: the encoding times are the real tower's, the TTFT rows then measure the tiny text model. For
the full model's TTFT, pass a full-size checkpoint with a tower:
    python -c "from lily.checkpoint import synthetic; synthetic.make_checkpoint('full-vision', \\
        'qwen3.6-35b-a3b', with_tokenizer=False, vision=True)"
Images are random pixels of the exact size (a 1-megapixel image is 1024 x 1024: 4096 patches, 1024 tokens).
Each row: one warm-up, then the median of --rounds. "encode" is Model.encode_images on prepared images
(upload, tower, download of the merged tokens); "TTFT" is a reset session's generate(max_tokens=1) of
[vision_start, image pads, vision_end] + the question (preparing the image, encoding it, prefill, the first
sample); "text TTFT" is the same number of text tokens without the image.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np

import lily
from lily.checkpoint import synthetic

FULL_TOWER = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
              "num_position_embeddings": 2304}
START, END = 248053, 248054


def median_ms(fn, rounds: int) -> float:
    fn()  # warm-up: kernel setup, allocations
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def picture(megapixels: float, seed: int = 0) -> np.ndarray:
    side = int(round((megapixels * 2**20) ** 0.5 / 32)) * 32  # a square of whole 32-pixel merge blocks
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint with a vision tower (default: tiny text + full-size tower)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--megapixels", default="0.25,1,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--question", type=int, default=100, help="text tokens after the image")
    ap.add_argument("--json")
    args = ap.parse_args()
    path = args.model or synthetic.make_checkpoint(tempfile.mkdtemp(), "tiny", with_tokenizer=False, vision=FULL_TOWER)
    model = lily.Model.load(path, device=args.device)
    v = model.config.vision
    print(f"{path}: tower {v.depth} blocks x {v.hidden_size} ({v.num_heads} heads), text hidden "
          f"{model.config.hidden_size}, device {model.device}")
    rng = np.random.default_rng(1)
    rows = []
    for mp in (float(x) for x in args.megapixels.split(",")):
        img = picture(mp)
        prepared = model.prepare_images([img], max_pixels=img.shape[0] * img.shape[1])
        im = prepared[0]
        pixels, grids = im.pixels, np.array([im.grid], np.int32)
        encode = median_ms(lambda: model._engine.encode_images(pixels, grids), args.rounds)
        _, prof = model._engine.encode_images(pixels, grids, profile=True)
        question = rng.integers(1000, 100000, args.question).tolist()
        ids = [START] + [model.config.image_token_id] * im.num_tokens + [END] + question
        session = model.new_session(max_context=len(ids) + 8)  # allocated once, as a server's

        def ttft(with_image: bool) -> None:
            session.reset()
            prompt = ids if with_image else [5] * (im.num_tokens + 2) + question
            model.generate(prompt, session=session, images=[img] if with_image else None, max_tokens=1,
                           temperature=0, ignore_eos=True)

        row = {"megapixels": mp, "size": list(img.shape[:2]), "patches": int(pixels.shape[0]),
               "tokens": im.num_tokens, "encode_ms": encode, "ttft_ms": median_ms(lambda: ttft(True), args.rounds),
               "text_ttft_ms": median_ms(lambda: ttft(False), args.rounds),
               "profile": {k: {"ms": ms, "calls": n} for k, (ms, n) in prof.items()}}
        rows.append(row)
        print(f"\n{mp} MP ({img.shape[0]} x {img.shape[1]}: {row['patches']} patches, {im.num_tokens} tokens): encode "
              f"{encode:.1f} ms, TTFT image + {args.question} tokens {row['ttft_ms']:.1f} ms, text-only TTFT of the "
              f"same length {row['text_ttft_ms']:.1f} ms")
        total = sum(ms for ms, _ in prof.values())
        print(f"  tower ops (one profiled encode, device time {total:.1f} ms):")
        for name, (ms, n) in sorted(prof.items(), key=lambda kv: -kv[1][0]):
            print(f"    {name:34s} {ms:8.2f} ms {n:5d} calls {100 * ms / total:5.1f}%")
    print("\n| MP | patches | tokens | encode ms | TTFT ms (image + question) | text-only TTFT ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['megapixels']} | {r['patches']} | {r['tokens']} | {r['encode_ms']:.1f} | {r['ttft_ms']:.1f} | "
              f"{r['text_ttft_ms']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(path), "device": model.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
