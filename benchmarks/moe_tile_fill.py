"""Tile count, fill and a cost model of the MoE grouped products' tile maps, on the CPU (no GPU).

Routing: T tokens x top-8 over 256 experts, drawn three ways:
  synthetic  the synthetic checkpoint's router (rows ~ N(0, (3/sqrt(H))^2), H = 2048) on random normalised
             hidden states: softmax top-8, as moe_topk picks (near-uniform expert loads);
  skew 0.5   expert popularity p_e ~ exp(0.5 z_e) (z standard normal), tokens pick 8 distinct experts by
             p: a trained router's imbalance (load coefficient of variation ~0.5);
  skew 1.0   the same with exp(1.0 z_e) (a strongly imbalanced router).
Maps (moe_scatter's, per expert with n routed rows):
  128        ceil(n / 128) tiles of 128 rows (today's map at >= 64 rows per expert);
  128+64     moe_tile_counts: floor(n / 128) tiles of 128, then the remainder r = n % 128 as one more
             128-row tile when r > 64, or as one 64-row tail tile (map 2, the BM = 64 launch) when 0 < r <= 64.
Fill: real rows / (tiles x BM). Cost model of one work unit (a row tile x a column tile, all K): a 128-row
unit costs 1, a 64-row unit alpha (its dequantisation is the same as at 128 rows, its wgmma work half;
gemm_lab: alpha ~0.77 for the plain gate product, docs/perf-notes.md). Each launch's time is its work
spread over the SMs, rounded up to whole waves of units (the persistent kernel takes units round-robin).
Run: python3 benchmarks/moe_tile_fill.py [--alpha 0.77] [--seeds 4]
"""
from __future__ import annotations

import argparse
import math

import numpy as np

E, TOP_K, H, SMS = 256, 8, 2048, 132
WIDE, TAIL = 128, 64


def synthetic_counts(T: int, rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((E, H), dtype=np.float32) * np.float32(3 / math.sqrt(H))
    h = rng.standard_normal((T, H), dtype=np.float32)
    top = np.argpartition(-(h @ w.T), TOP_K, axis=1)[:, :TOP_K]
    return np.bincount(top.ravel(), minlength=E)


def skewed_counts(T: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    p = np.exp(sigma * rng.standard_normal(E))
    # distinct experts per token by p (Gumbel top-k: sampling without replacement in proportion to p)
    keys = np.log(p)[None, :] + rng.gumbel(size=(T, E))
    top = np.argpartition(-keys, TOP_K, axis=1)[:, :TOP_K]
    return np.bincount(top.ravel(), minlength=E)


def tiles_128(n: np.ndarray) -> tuple[int, int]:
    return int(np.sum((n + WIDE - 1) // WIDE)), 0


def tiles_split(n: np.ndarray) -> tuple[int, int]:
    """moe_tile_counts (kernels/moe_routing.cuh): (128-row tiles, 64-row tail tiles)."""
    r = n % WIDE
    wide = n // WIDE + (r > TAIL)
    tail = (r > 0) & (r <= TAIL)
    return int(np.sum(wide)), int(np.sum(tail))


def launch_time(units: int, unit_cost: float) -> float:
    return math.ceil(units / SMS) * unit_cost if units else 0.0


def model(n: np.ndarray, col_tiles: int, alpha: float, split: bool) -> tuple[int, int, float, float]:
    wide, tail = tiles_split(n) if split else tiles_128(n)
    rows = int(n.sum())
    fill = rows / (wide * WIDE + tail * TAIL)
    # one launch per map (the tail launch follows the wide one)
    t = launch_time(wide * col_tiles, 1.0) + launch_time(tail * col_tiles, alpha)
    return wide, tail, fill, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alpha", type=float, default=0.77, help="cost of a 64-row unit relative to a 128-row unit")
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    products = {"gate/up (gated, 4 col tiles)": 4, "down (8 col tiles)": 8}
    print(f"alpha = {args.alpha}; times in units of one 128-row work unit; mean over {args.seeds} seeds\n")
    print("| routing | T | rows/expert mean, std, max | map | 128-row tiles | 64-row tiles | fill | "
          + " | ".join(f"{k} waves" for k in products) + " | vs 128 |")
    print("|---|---:|---|---|---:|---:|---:|" + "---:|" * len(products) + "---:|")
    for kind in ("synthetic", "skew 0.5", "skew 1.0"):
        for T in (2048, 4096, 8192):
            stats = {False: [], True: []}
            moments = []
            for seed in range(args.seeds):
                rng = np.random.default_rng([seed, T])
                n = (synthetic_counts(T, rng) if kind == "synthetic"
                     else skewed_counts(T, float(kind.split()[1]), rng))
                moments.append((n.mean(), n.std(), n.max()))
                for split in (False, True):
                    res = [model(n, c, args.alpha, split) for c in products.values()]
                    stats[split].append((res[0][0], res[0][1], res[0][2], [r[3] for r in res]))
            mean, std, mx = np.mean(moments, axis=0)
            base = None
            for split in (False, True):
                s = stats[split]
                wide = np.mean([x[0] for x in s])
                tail = np.mean([x[1] for x in s])
                fill = np.mean([x[2] for x in s])
                times = np.mean([x[3] for x in s], axis=0)
                if base is None:
                    base = times
                gain = " / ".join(f"{t / b:.3f}" for t, b in zip(times, base))
                print(f"| {kind} | {T} | {mean:.0f}, {std:.1f}, {mx:.0f} | {'128+64' if split else '128'} | "
                      f"{wide:.1f} | {tail:.1f} | {fill:.3f} | " + " | ".join(f"{t:.2f}" for t in times)
                      + f" | {gain} |")


if __name__ == "__main__":
    main()
