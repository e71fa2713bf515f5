#!/usr/bin/env python3
"""Instruction budget of the decode GEMV's main loop, from its SASS (docs/perf-notes.md, "the decode GEMV's
instruction budget (SASS)", eleventh session).

Prints the basic blocks of a kernel's main loop (the backward branch spanning the most IMMA) with their
instruction counts by class, tagged by what they hold (IMMA: a segment; LDG.128: a unit's loads; BAR/SHFL:
the end of a pass). Counts are static (instructions in the block), i.e. per warp per execution of the block.

  nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -O3 -DLILY_WITH_CUDA \
       -I csrc -cubin -o linear.cubin csrc/cuda/linear.cu
  python3 benchmarks/gemv_sass_budget.py linear.cubin [mangled kernel name] [--unit] [-v]

--unit: one warp-unit's path at in_proj's plan (ks = 8: every unit ends a pass), summed by part (segments,
loads, resolve, pass end, counters; warp 0's row sum apart), for the linear kernel's instances.

cuobjdump comes from CUOBJDUMP or PATH (where the CUDA install lacks it, PyPI's nvidia-cuda-cuobjdump
wheel has it under nvidia/cu13/bin/ of the folder it is installed to).
"""
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

DEFAULT_KERNEL = "_ZN4lily4cuda22linear_gemv_mma_kernelILi4ELi2ELb1EEEvNS0_15MmaLinearParamsE"

# Classes (issue slots all; pipes: the CUDA guide's rates per SM per clock in the perf-notes section).
CLASSES = [
    ("ldg", r"LDG|STG|RED|ATOM"),
    ("lds", r"LDS|STS"),
    ("shfl", r"SHFL"),
    ("imma", r"IMMA|HMMA"),
    ("fp32", r"FADD|FMUL|FFMA|FMNMX|FSEL|FSETP"),
    ("conv", r"I2FP|I2F|F2I|F2FP|FRND"),
    ("imad", r"IMAD"),  # IMAD, IMAD.MOV/SHL/IADD/WIDE: the FMA pipe's integer forms
    ("alu", r"LOP3|IADD3|SHF|LEA|SEL|ISETP|PRMT|VIADD|VIMNMX|VIADDMNMX|IMNMX|MOV|CS2R|PLOP3|IABS|POPC|FLO|BMSK"),
    ("uniform", r"U[A-Z0-9]+|S2UR|S2R|LDC|R2UR"),
    ("control", r"BRA|BSSY|BSYNC|WARPSYNC|BAR|EXIT|NOP|PREEXIT|YIELD|MEMBAR|ERRBAR|CCTL|CGAERRBAR"),
]


def cls(op):
    for name, pat in CLASSES:
        if re.fullmatch(pat, op):
            return name
    return "other"


def sass(cubin, kernel):
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool:
        sys.exit("gemv_sass_budget: no cuobjdump on PATH; set CUOBJDUMP to its path")
    text = subprocess.run([tool, "-sass", "-fun", kernel, cubin], check=True, capture_output=True, text=True).stdout
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    return ins


def opcode(text):
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    return t.split()[0].split(".")[0]


def target(text):
    m = re.search(r"\bBRA(?:\.\w+)*\s+(?:\w+,\s*)?0x([0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cubin = sys.argv[1]
    kernel = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_KERNEL
    ins = sass(cubin, kernel)
    # the main loop: the backward branch whose span holds the most IMMA (the shortest such span: a
    # divergent-shuffle fallback far below also branches back into the loop)
    back = [(a, target(t)) for a, t in ins if target(t) is not None and target(t) < a]
    mmas = lambda b: sum(1 for a, t in ins if b[1] <= a <= b[0] and opcode(t) in ("IMMA", "HMMA"))
    end, head = max(back, key=lambda b: (mmas(b), -(b[0] - b[1])))
    loop = [(a, t) for a, t in ins if head <= a <= end]
    starts = {head} | {target(t) for _, t in loop if target(t) is not None and head <= target(t) <= end}
    starts |= {loop[i + 1][0] for i, (_, t) in enumerate(loop[:-1]) if "BRA" in t or "EXIT" in t or "BAR" in t}
    blocks, cur = [], []
    for a, t in loop:
        if a in starts and cur:
            blocks.append(cur)
            cur = []
        cur.append((a, t))
    blocks.append(cur)
    names = [n for n, _ in CLASSES] + ["other"]
    print(f"{kernel}: {len(ins)} instructions, main loop 0x{head:04x}-0x{end:04x} ({len(loop)})")
    print(f"{'block':>11} {'n':>4} " + " ".join(f"{n:>7}" for n in names) + "  tag")
    total = Counter()
    counts, tags = [], []
    for b in blocks:
        c = Counter(cls(opcode(t)) for _, t in b)
        total += c
        ops = [opcode(t) for _, t in b]
        tag = ("segment" if "IMMA" in ops else "loads" if any("LDG.E.NA.128" in t for _, t in b) else
               "pass end" if ("BAR" in ops or "SHFL" in ops or "STS" in ops) else
               "pass: row sum" if ("LDS" in ops and "FADD" in ops) else "")
        counts.append(c)
        tags.append(tag)
        print(f"{b[0][0]:04x}-{b[-1][0]:04x} {len(b):>4} " + " ".join(f"{c[n]:>7}" for n in names) + f"  {tag}")
    print(f"{'loop total':>11} {sum(total.values()):>4} " + " ".join(f"{total[n]:>7}" for n in names))
    if "--unit" in sys.argv:
        unit_path(counts, tags, names)
    if "-v" in sys.argv:
        for b in blocks:
            print()
            for a, t in b:
                print(f"  {a:04x} {cls(opcode(t)):>8}  {t}")


def unit_path(counts, tags, names):
    """One warp-unit as a warp other than warp 0 runs it when every unit ends a pass (in_proj's plan, ks = 8):
    the loop's first half, by block position (perf-notes, twelfth session, "the decode GEMV's frame cut")."""
    main = [i for i, t in enumerate(tags) if t != "pass: row sum"]
    pos = {i: k for k, i in enumerate(main)}
    end = next(i for i in main if tags[i] == "pass end")
    cu = main[pos[end] - 2]  # the unit counter's check, then the shuffles' convergence check
    first_seg = main[1]
    segs = [i for i in main[1:pos[cu]] if tags[i] == "segment" or sum(counts[i].values()) == 1]
    if counts[first_seg]["imma"] > max((counts[i]["imma"] for i in segs[1:]), default=0):
        segs = [first_seg]  # one block a unit; the blocks after it are a warp's odd last segment
    loads = next(i for i in main if tags[i] == "loads")
    ends = [i for i in main if tags[i] == "pass end"][:3]
    ends.append(main[pos[ends[-1]] + 1])
    L = pos[loads]
    parts = {"segments": segs, "loads": [main[L - 1], loads], "resolve": [main[L + 2]], "pass end": ends,
             "counters": [main[0], cu, main[pos[cu] + 1], main[L - 2], main[L + 1], main[L + 3]]}
    print(f"\nper unit (warp 0's row sum not included) {'n':>4} " + " ".join(f"{n:>7}" for n in names))
    total = Counter()
    for part, idx in parts.items():
        c = sum((counts[i] for i in idx), Counter())
        total += c
        print(f"{part:>41} {sum(c.values()):>4} " + " ".join(f"{c[n]:>7}" for n in names))
    print(f"{'total':>41} {sum(total.values()):>4} " + " ".join(f"{total[n]:>7}" for n in names))
    if "-v" in sys.argv:
        for b in blocks:
            print()
            for a, t in b:
                print(f"  {a:04x} {cls(opcode(t)):>8}  {t}")


if __name__ == "__main__":
    main()
