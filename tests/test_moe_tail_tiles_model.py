"""A host model (NumPy, no GPU) of moe_scatter_kernel's two tile maps (csrc/cuda/kernels/moe_routing.cuh): warp 0's
per-lane runs of ceil(E / 32) experts and its exclusive scans of the rows, the tile_rows-row tiles and the tail tiles,
then each CTA's writes of the experts e with e % C == c. Expert e's floor(n_e / tile_rows) full tiles go to the first
map, its last remainder r_e = n_e mod tile_rows to the first map when r_e > tail_rows and to the tail map when
0 < r_e <= tail_rows; tail_rows = 0 is the map of ceil(n_e / tile_rows) tiles alone. Checks, read the way find_tile
reads a map (rows [row0, min(row_end[e], row0 + BM)) with BM = the map's rows), that every grouped row lies in
exactly one tile of one map and inside its expert's rows, that no tile is empty, and the bounds moe.cu sizes the maps
by (max_routed_tiles for the first, E for the tail). `python tests/test_moe_tail_tiles_model.py` prints the rows
computed with and without the tail map at a 4K prompt (4096 x top-8 over 256 experts)."""
from __future__ import annotations

import numpy as np
import pytest

LINEAR_TILE_ROWS, LINEAR_WIDE_TILE_ROWS = 64, 128


def scatter_maps(n, tile_rows, tail_rows, chunks):
    """moe_scatter_kernel's row_end and both maps for the per-expert row counts n (warp 0's scan, CTA writes)."""
    E = len(n)

    def main_tiles(m):
        return m // tile_rows + (1 if m % tile_rows > tail_rows else 0)

    def tail_tiles(m):
        return 1 if 0 < m % tile_rows <= tail_rows else 0

    per = (E + 31) // 32
    runs = [(min(lane * per, E), min(lane * per + per, E)) for lane in range(32)]
    sums = [(sum(n[e0:e1]), sum(main_tiles(m) for m in n[e0:e1]), sum(tail_tiles(m) for m in n[e0:e1]))
            for e0, e1 in runs]
    excl = np.concatenate([[[0, 0, 0]], np.cumsum(sums, axis=0)[:-1]]).astype(int)  # the shuffle scan, exclusive
    row_end = np.full(E, -1)
    tile_expert, tile_row0, tail_expert, tail_row0 = {}, {}, {}, {}
    num_tiles = num_tail = None
    for c in range(chunks):
        for lane, (e0, e1) in enumerate(runs):
            start, tile, tail = excl[lane]
            for e in range(e0, e1):
                m, nt, nu = n[e], main_tiles(n[e]), tail_tiles(n[e])
                if e % chunks == c:
                    row_end[e] = start + m
                    for i in range(nt):
                        assert tile + i not in tile_expert, "two writes of one tile"
                        tile_expert[tile + i], tile_row0[tile + i] = e, start + i * tile_rows
                    if nu:
                        assert tail not in tail_expert, "two writes of one tail tile"
                        tail_expert[tail], tail_row0[tail] = e, start + nt * tile_rows
                start, tile, tail = start + m, tile + nt, tail + nu
            if c == 0 and lane == 31:
                num_tiles, num_tail = tile, tail
    assert sorted(tile_expert) == list(range(num_tiles)) and sorted(tail_expert) == list(range(num_tail))
    main = [(tile_expert[i], tile_row0[i]) for i in range(num_tiles)]
    tails = [(tail_expert[i], tail_row0[i]) for i in range(num_tail)]
    return row_end, main, tails


def check_maps(n, tile_rows, tail_rows, chunks, T, top_k):
    E = len(n)
    row_end, main, tails = scatter_maps(n, tile_rows, tail_rows, chunks)
    start = np.concatenate([[0], np.cumsum(n)[:-1]])
    assert np.array_equal(row_end, start + n)
    covered = np.zeros(int(np.sum(n)), int)
    for tiles, bm in ((main, tile_rows), (tails, tail_rows)):
        for e, r0 in tiles:
            rows = min(row_end[e], r0 + bm) - r0  # find_tile's rows
            assert rows > 0, "an empty tile"
            assert start[e] <= r0 and r0 + rows <= row_end[e]
            covered[r0:r0 + rows] += 1
    assert (covered == 1).all(), "a row in no tile or in two"
    TK = T * top_k
    assert len(main) <= -(-TK // LINEAR_TILE_ROWS) + min(E, TK)  # moe.cu's max_routed_tiles
    assert len(tails) <= E
    return main, tails


def routed_counts(rng, T, E, top_k):
    """Rows an expert for T tokens each choosing top_k distinct experts uniformly."""
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :top_k]
    return np.bincount(ids.ravel(), minlength=E)


@pytest.mark.parametrize("T, E, top_k", [(4096, 256, 8), (2048, 256, 8), (1100, 3, 2), (400, 8, 4), (37, 40, 3)])
@pytest.mark.parametrize("tail_rows", [0, LINEAR_TILE_ROWS])
def test_scatter_maps_cover_every_row_once(T, E, top_k, tail_rows):
    rng = np.random.default_rng(T + E + tail_rows)
    chunks = -(-T // 256)  # MOE_ROUTE_TOKENS
    for _ in range(3):
        n = routed_counts(rng, T, E, top_k)
        main, tails = check_maps(n, LINEAR_WIDE_TILE_ROWS, tail_rows, chunks, T, top_k)
        if tail_rows == 0:  # no tail map: ceil(n_e / 128) tiles, as before the tail map
            assert not tails and len(main) == int(np.sum(-(-n // LINEAR_WIDE_TILE_ROWS)))
        # the whole map (the down product's): the scan with no tail map, whatever tail_rows is
        whole, no_tails = check_maps(n, LINEAR_WIDE_TILE_ROWS, 0, chunks, T, top_k)
        assert not no_tails and len(whole) == int(np.sum(-(-n // LINEAR_WIDE_TILE_ROWS)))


def test_scatter_maps_edges():
    # remainders 0, 1, 64, 65, 127 and empty experts; 64-row maps with no tail map (moe.cu's narrow case)
    n = np.array([0, 128, 129, 192, 193, 255, 64, 65, 1, 0, 256, 320])
    main, tails = check_maps(n, LINEAR_WIDE_TILE_ROWS, LINEAR_TILE_ROWS, 2, 200, 8)
    assert [e for e, _ in tails] == [2, 3, 6, 8, 11]
    assert [e for e, _ in main] == [1, 2, 3, 4, 4, 5, 5, 7, 10, 10, 11, 11]
    main, tails = check_maps(n, LINEAR_TILE_ROWS, 0, 3, 200, 8)
    assert not tails and len(main) == int(np.sum(-(-n // LINEAR_TILE_ROWS)))


def padded_rows(n):
    before = int(np.sum(-(-n // LINEAR_WIDE_TILE_ROWS))) * LINEAR_WIDE_TILE_ROWS
    main, tails = check_maps(n, LINEAR_WIDE_TILE_ROWS, LINEAR_TILE_ROWS, 16, 4096, 8)
    return before, len(main) * LINEAR_WIDE_TILE_ROWS + len(tails) * LINEAR_TILE_ROWS, len(main), len(tails)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    for _ in range(4):
        n = routed_counts(rng, 4096, 256, 8)
        before, after, m, t = padded_rows(n)
        print(f"rows 32768: computed {before} with 128-row tiles alone, {after} with the tail map "
              f"({m} 128-row + {t} 64-row tiles)")
