"""Summary of an Nsight Compute source page (`ncu_kernel.py --page source --out F.csv`): where a kernel's warps
wait, instruction by instruction. Prints the warp-stall reasons over the whole kernel, the samples and executed
instructions by opcode, the instructions with the most samples (each with its top stall reasons), and with
`--range LO HI` (hex addresses, low 20 bits as printed) a listing of that address range: executed count,
share of samples, SASS, top two reasons. `--buckets N` sums the samples by N-byte address buckets (hex), which
shows a kernel's regions (a producer's loop, a consumer's loop, an epilogue).

    python3 benchmarks/ncu_source.py src_dense.csv [--top 25] [--range a7200 a8400] [--buckets 400]

The sixteenth session read the prefill GEMM's scale-load stall and its gather producer's address arithmetic
from these (docs/perf-notes.md, "what binds the prefill GEMM, by ncu").
"""

from __future__ import annotations

import argparse
import collections
import csv


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise SystemExit(f"ncu_source: {path} has no 'Address' header row (not an ncu source page CSV?)")
    header = rows[start]
    return header, [r for r in rows[start + 1:] if len(r) == len(header)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="the CSV that ncu_kernel.py --page source wrote")
    ap.add_argument("--top", type=int, default=25, help="instructions with the most samples to print")
    ap.add_argument("--range", nargs=2, metavar=("LO", "HI"), help="list the instructions in [LO, HI] (hex)")
    ap.add_argument("--buckets", help="sum samples by address buckets of this many bytes (hex)")
    a = ap.parse_args()
    header, data = load(a.csv)
    col = {h: i for i, h in enumerate(header)}
    for need in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"):
        if need not in col:
            raise SystemExit(f"ncu_source: column {need!r} missing in {a.csv}")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = [number(r[col["Warp Stall Sampling (All Samples)"]]) for r in data]
    total = sum(samples) or 1.0
    executed = [number(r[col["Instructions Executed"]]) for r in data]

    by_reason = collections.Counter()
    by_op, by_op_inst = collections.Counter(), collections.Counter()
    for r, s, n in zip(data, samples, executed):
        words = [w for w in r[col["Source"]].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        by_op[op] += s
        by_op_inst[op] += n
        for st in reasons:
            by_reason[st] += number(r[col[st]])
    print(f"samples {total:.0f}, instructions executed {sum(executed):.0f}")
    reason_total = sum(by_reason.values()) or 1.0
    print("stall reasons: " + ", ".join(f"{k[6:]} {v / reason_total:.1%}" for k, v in by_reason.most_common(10)))
    inst_total = sum(by_op_inst.values()) or 1.0
    print("| opcode | samples | instructions |\n|---|---:|---:|")
    for op, s in by_op.most_common(16):
        print(f"| {op} | {s / total:.1%} | {by_op_inst[op] / inst_total:.1%} |")

    def top_reasons(r: list[str], k: int) -> str:
        pairs = sorted(((number(r[col[st]]), st[6:]) for st in reasons), reverse=True)[:k]
        return " ".join(f"{name}:{v / total:.1%}" for v, name in pairs if v)

    print("top instructions (share of samples, address, SASS, reasons):")
    order = sorted(range(len(data)), key=lambda i: -samples[i])[: a.top]
    for i in order:
        r = data[i]
        print(f"  {samples[i] / total:5.1%} {r[col['Address']]} {r[col['Source']].strip()[:70]:70s} {top_reasons(r, 3)}")

    def low(r: list[str]) -> int:
        return int(r[col["Address"]], 16) & 0xFFFFF

    if a.buckets:
        step = int(a.buckets, 16)
        sums: dict[int, list] = collections.defaultdict(lambda: [0.0, 0.0, ""])
        for r, s, n in zip(data, samples, executed):
            b = sums[low(r) // step * step]
            b[0] += s
            b[1] += n
            b[2] = b[2] or r[col["Source"]].strip()[:40]
        print(f"by {a.buckets}-byte address bucket (share of samples, instructions executed, first SASS):")
        for addr in sorted(sums):
            s, n, first = sums[addr]
            if s / total >= 0.005:
                print(f"  {addr:05x} {s / total:6.1%} {n:>12.0f} {first}")
    if a.range:
        lo, hi = int(a.range[0], 16), int(a.range[1], 16)
        for r, s, n in zip(data, samples, executed):
            if lo <= low(r) <= hi:
                print(f"{low(r):05x} {n:>10.0f} {s / total:5.1%} {r[col['Source']].strip()[:75]:75s} {top_reasons(r, 2)}")


if __name__ == "__main__":
    main()
