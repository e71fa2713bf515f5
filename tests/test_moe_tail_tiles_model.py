"""A host model (NumPy, no GPU) of moe_scatter_kernel's tile maps (csrc/cuda/kernels/moe_routing.cuh): warp 0's
per-lane runs of ceil(E / 32) experts and its exclusive scans of the rows, the tile_rows-row tiles and the tail tiles,
then each CTA's writes of the experts e with e % C == c. Expert e's floor(n_e / tile_rows) full tiles go to the first
map, its last remainder r_e = n_e mod tile_rows to the first map when r_e > tail_rows and to the tail map when
0 < r_e <= tail_rows; tail_rows = 0 is the map of ceil(n_e / tile_rows) tiles alone. Checks, read the way find_tile
reads a map (rows [row0, min(row_end[e], row0 + BM)) with BM = the map's rows), that every grouped row lies in
exactly one tile of one map and inside its expert's rows, that no tile is empty, and the bounds moe.cu sizes the maps
by (max_routed_tiles for the first, E for the tail). The down product's whole map (ceil(n_e / 128) tiles) and merge
map (an expert past 128 rows with a remainder of at most 32: its last full tile and the remainder as one tile of
the BM = 160 kernel) are checked the same way. `python tests/test_moe_tail_tiles_model.py` prints the rows
computed with and without the tail map at a 4K prompt (4096 x top-8 over 256 experts)."""
from __future__ import annotations

import numpy as np
import pytest

LINEAR_TILE_ROWS, LINEAR_WIDE_TILE_ROWS = 64, 128
MERGE_ROWS = 32  # moe.cu: LINEAR_MERGE_TILE_ROWS - LINEAR_WIDE_TILE_ROWS


def scatter_maps(n, tile_rows, tail_rows, chunks, merge_rows=0):
    """moe_scatter_kernel's row_end and its maps for the per-expert row counts n (warp 0's scan, CTA writes): the
    tile_rows-row map, the tail map, the whole map and the merge map (each a list of (expert, row0))."""
    E = len(n)

    def counts(m):  # main, tail, whole, merge tiles of an expert with m rows
        merge = 1 if m > tile_rows and 0 < m % tile_rows <= merge_rows else 0
        return (m // tile_rows + (1 if m % tile_rows > tail_rows else 0), 1 if 0 < m % tile_rows <= tail_rows else 0,
                -(-m // tile_rows) - 2 * merge, merge)

    per = (E + 31) // 32
    runs = [(min(lane * per, E), min(lane * per + per, E)) for lane in range(32)]
    sums = [[sum(n[e0:e1])] + [sum(counts(m)[i] for m in n[e0:e1]) for i in range(4)] for e0, e1 in runs]
    excl = np.concatenate([[[0] * 5], np.cumsum(sums, axis=0)[:-1]]).astype(int)  # the shuffle scan, exclusive
    row_end = np.full(E, -1)
    maps = [{}, {}, {}, {}]  # tile index -> (expert, row0)
    totals = None
    for c in range(chunks):
        for lane, (e0, e1) in enumerate(runs):
            start, *at = excl[lane]
            for e in range(e0, e1):
                m, (nt, nu, na, nm) = n[e], counts(n[e])
                if e % chunks == c:
                    row_end[e] = start + m
                    writes = ([(0, at[0] + i, start + i * tile_rows) for i in range(nt)]
                              + [(1, at[1], start + nt * tile_rows)] * nu
                              + [(2, at[2] + i, start + i * tile_rows) for i in range(na)]
                              + [(3, at[3], start + na * tile_rows)] * nm)
                    for k, i, r0 in writes:
                        assert i not in maps[k], "two writes of one tile"
                        maps[k][i] = (e, r0)
                start, at = start + m, [a + b for a, b in zip(at, (nt, nu, na, nm))]
            if c == 0 and lane == 31:
                totals = at
    for k in range(4):
        assert sorted(maps[k]) == list(range(totals[k]))
    return (row_end, *[[maps[k][i] for i in range(totals[k])] for k in range(4)])


def covers_once(n, row_end, *tiled):
    """Every grouped row in exactly one tile of the (tiles, BM) pairs, read as find_tile reads them."""
    start = np.concatenate([[0], np.cumsum(n)[:-1]])
    assert np.array_equal(row_end, start + n)
    covered = np.zeros(int(np.sum(n)), int)
    for tiles, bm in tiled:
        for e, r0 in tiles:
            rows = min(row_end[e], r0 + bm) - r0  # find_tile's rows
            assert rows > 0, "an empty tile"
            assert start[e] <= r0 and r0 + rows <= row_end[e]
            covered[r0:r0 + rows] += 1
    assert (covered == 1).all(), "a row in no tile or in two"


def check_maps(n, tile_rows, tail_rows, chunks, T, top_k):
    E = len(n)
    row_end, main, tails, _, _ = scatter_maps(n, tile_rows, tail_rows, chunks)
    covers_once(n, row_end, (main, tile_rows), (tails, tail_rows))
    TK = T * top_k
    assert len(main) <= -(-TK // LINEAR_TILE_ROWS) + min(E, TK)  # moe.cu's max_routed_tiles
    assert len(tails) <= E
    return main, tails


def check_whole_maps(n, merge_rows, chunks, T, top_k):
    """The down product's whole map (BM 128) and merge map (BM 128 + merge_rows): every row once, the merged
    tiles exactly the experts with more than 128 rows and a remainder of 1..merge_rows, within moe.cu's bounds."""
    E, W = len(n), LINEAR_WIDE_TILE_ROWS
    row_end, _, _, whole, merged = scatter_maps(n, W, LINEAR_TILE_ROWS, chunks, merge_rows)
    covers_once(n, row_end, (whole, W), (merged, W + merge_rows))
    assert [e for e, _ in merged] == [e for e in range(E) if n[e] > W and 0 < n[e] % W <= merge_rows]
    for e, r0 in merged:
        assert W < row_end[e] - r0 <= W + merge_rows  # one merged tile: the last full one and the remainder
    assert len(whole) <= -(-T * top_k // LINEAR_TILE_ROWS) + min(E, T * top_k) and len(merged) <= E
    return whole, merged


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
        # the whole map (the down product's): ceil(n_e / 128) tiles whatever tail_rows; with the merge map,
        # two fewer for each merged expert
        whole, merged = check_whole_maps(n, 0, chunks, T, top_k)
        assert not merged and len(whole) == int(np.sum(-(-n // LINEAR_WIDE_TILE_ROWS)))
        whole, merged = check_whole_maps(n, MERGE_ROWS, chunks, T, top_k)
        assert len(whole) + 2 * len(merged) == int(np.sum(-(-n // LINEAR_WIDE_TILE_ROWS)))


def test_scatter_maps_edges():
    # remainders 0, 1, 64, 65, 127 and empty experts; 64-row maps with no tail map (moe.cu's narrow case)
    n = np.array([0, 128, 129, 192, 193, 255, 64, 65, 1, 0, 256, 320])
    main, tails = check_maps(n, LINEAR_WIDE_TILE_ROWS, LINEAR_TILE_ROWS, 2, 200, 8)
    assert [e for e, _ in tails] == [2, 3, 6, 8, 11]
    assert [e for e, _ in main] == [1, 2, 3, 4, 4, 5, 5, 7, 10, 10, 11, 11]
    main, tails = check_maps(n, LINEAR_TILE_ROWS, 0, 3, 200, 8)
    assert not tails and len(main) == int(np.sum(-(-n // LINEAR_TILE_ROWS)))
    # the merge map: remainders 1..32 of experts past 128 rows (129, 160, 256 + 1 .. 32), not 161 or 128
    n = np.array([129, 160, 161, 128, 288, 289, 0, 22, 150, 384])
    whole, merged = check_whole_maps(n, MERGE_ROWS, 2, 200, 8)
    assert [e for e, _ in merged] == [0, 1, 4, 8]
    assert [e for e, _ in whole] == [2, 2, 3, 4, 5, 5, 5, 7, 9, 9, 9]


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
        whole, merged = check_whole_maps(n, MERGE_ROWS, 16, 4096, 8)
        print(f"  the down product: {len(whole)} 128-row + {len(merged)} merged 160-row tiles "
              f"(against {int(np.sum(-(-n // LINEAR_WIDE_TILE_ROWS)))} 128-row tiles alone)")
