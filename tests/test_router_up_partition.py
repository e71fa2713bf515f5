"""The work partition of moe_router_up_kernel (csrc/cuda/kernels/moe_router_up.cuh) on the CPU, its index
arithmetic mirrored line for line: the router rows and chunks of a cluster's CTAs, the gate pieces and the
DSMEM broadcast of the logits cover everything exactly once; the up product's passes over the grid of whole
clusters (moe.cu: moe_up_mma's grid rounded up to clusters, moe_up_mma's plan) compute every (gate, up) row
pair exactly once, in the tiles and K split of moe_up_mma_kernel's launch. The GPU side (same bits as the
router kernel then moe_up) is tests/gpu/test_moe.py's test_moe_router_up*."""
from __future__ import annotations

import math

import pytest

MMA_WARPS, MMA_SPU, MMA_THREADS = 8, 2, 256
ROUTER_COLS, ROUTER_CHUNKS, ROUTER_ROWS, RU_ROWS, GATE_PIECES = 2048, 128, 16, 8, 16


def mma_plan_for(tiles, segments, resident, dependent):
    """gemv_plan.h's mma_plan_for: (ks, grid)."""
    best, best_cost = (1, 1), 1e300
    L = 3.0 if dependent else 0.5
    ks = 1
    while ks <= MMA_WARPS:
        if ks > 1 and ks > segments:
            break
        rt, spw = MMA_WARPS // ks, -(-segments // ks)
        upp = -(-spw // MMA_SPU)
        passes = -(-tiles // rt)
        rounds = -(-passes // resident)
        fill = resident / passes if passes < resident else 1.0
        cost = rounds * (upp + L) * math.sqrt(fill)
        if cost < best_cost:
            best_cost, best = cost, (ks, passes if passes < resident else resident)
        ks *= 2
    return best


def router_cover(E):
    """(row, chunk) -> times computed, (dst, logit) -> times stored, gate chunk -> times, over one cluster."""
    n = -(-E // ROUTER_ROWS)
    rows, logits, gate = {}, {}, {}
    for b in range(n):
        pieces = (GATE_PIECES - b + n - 1) // n
        for tid in range(MMA_THREADS):
            warp, lane = tid >> 5, tid & 31
            q = 32 * (warp % 4) + lane
            rl0 = RU_ROWS * (warp // 4)
            row0 = b * ROUTER_ROWS + rl0
            assert q // 32 == warp % 4  # a warp's butterfly runs over one group of 32 chunks
            for r in range(RU_ROWS):
                if row0 + r < E:  # gemv_load's ok; rows past E load zeros and are never stored
                    rows[(row0 + r, q)] = rows.get((row0 + r, q), 0) + 1
            j, dst = tid % ROUTER_ROWS, tid // ROUTER_ROWS
            if dst < n and b * ROUTER_ROWS + j < E:
                logits[(dst, b * ROUTER_ROWS + j)] = logits.get((dst, b * ROUTER_ROWS + j), 0) + 1
            piece = b + (tid >> 3) * n
            if tid < 8 * pieces:
                gc = 32 * (piece >> 2) + (piece & 3) + 4 * (tid & 7)
                gate[gc] = gate.get(gc, 0) + 1
                assert warp * 32 < 8 * pieces  # its warp runs the gate chunk (gate_warp)
    return n, rows, logits, gate


@pytest.mark.parametrize("E", [1, 16, 40, 129, 255, 256])
def test_router_partition(E):
    n, rows, logits, gate = router_cover(E)
    assert n <= 16
    assert rows == {(e, c): 1 for e in range(E) for c in range(ROUTER_CHUNKS)}
    assert logits == {(d, e): 1 for d in range(n) for e in range(E)}
    assert gate == {c: 1 for c in range(ROUTER_CHUNKS)}


def up_cover(K, I, Is, bits, resident, n):
    """Pairs finished by each CTA of moe_router_up_kernel's grid, mirroring mma_gemv_body's pass loop."""
    vals = 512 // bits
    total, segments = K * I + Is, ROUTER_COLS // vals
    tiles = -(-total // 8)
    ks, grid = mma_plan_for(tiles, segments, resident, True)  # moe_up_mma's plan: same ks, same sums
    G = -(-grid // n) * n  # whole clusters
    rt = MMA_WARPS // ks
    passes = -(-tiles // rt)
    done = {}
    for cta in range(G):
        for p in range(cta, passes, G):  # passes strided by gridDim.x
            for tl in range(rt):
                tile = p * rt + tl
                if tile >= tiles:
                    continue
                for r in range(8):  # finish: rows r < 8 of a tile, pairs < total
                    pair = tile * 8 + r
                    if pair < total:
                        done[pair] = done.get(pair, 0) + 1
    return total, ks, grid, G, passes, done


@pytest.mark.parametrize("E,K,I,Is,bits", [(256, 8, 512, 512, 4), (256, 8, 512, 512, 8), (129, 8, 128, 128, 4),
                                           (40, 4, 128, 128, 8), (16, 8, 128, 128, 4), (256, 1, 128, 128, 8)])
@pytest.mark.parametrize("sms", [132, 114, 78, 16])
def test_up_partition(E, K, I, Is, bits, sms):
    n = -(-E // ROUTER_ROWS)
    total, ks, grid, G, passes, done = up_cover(K, I, Is, bits, 2 * sms, n)
    assert done == {p: 1 for p in range(total)}
    assert G % n == 0 and grid <= G < grid + n


def test_model_dims_plan():
    # the header comment's numbers: 144 CTAs = 9 clusters of 16 on a 132-SM GPU, one pass each (ks = 2)
    total, ks, grid, G, passes, _ = up_cover(8, 512, 512, 4, 2 * 132, 16)
    assert (total, ks, grid, G, passes) == (4608, 2, 144, 144, 144)
