#!/usr/bin/env python3
"""A kernel's wgmma k-loop in SASS with the scheduling control bits decoded (docs/perf-notes.md, "the wgmma GEMM's
consumer k-tile in SASS", twentieth session).

The loop is the backward branch whose span holds the most HGMMA (the shortest such span). Prints its instruction
classes, then the loop cut into segments at every SYNCS / WARPGROUP / BRA (what a hand-over waits on) with each
segment's instruction count and sum of stall counts (cycles the scheduler holds the warp after each instruction,
latency not covered by scoreboards); -v lists every instruction: stall, yield bit, write / read scoreboard set,
scoreboards waited on, source line. Static: per warp, per pass, no waits on scoreboards or barriers counted.

  nvcc -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17 -Icsrc -Icsrc/cuda \
       -cubin -o linear.cubin csrc/cuda/linear.cu
  python3 benchmarks/hgmma_sass_loop.py linear.cubin <mangled kernel name> [-v]

nvdisasm comes from NVDISASM or PATH (PyPI's nvidia-cuda-nvdisasm wheel has it under nvidia/cu13/bin/).
Control bits (sm_70+; the high 64-bit word of an instruction): stall [41:44], yield [45], write scoreboard
[46:48], read scoreboard [49:51], wait mask [52:57] (7 = none for the scoreboards).
"""
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

CLASSES = [("HGMMA", r"HGMMA"), ("WARPGROUP", r"WARPGROUP"), ("SYNCS", r"SYNCS"), ("LDS", r"LDS"), ("LDG", r"LDG"),
           ("LDC", r"U?LDC"), ("LOP3", r"LOP3"), ("SHF", r"SHF"), ("HFMA2", r"HFMA2"), ("PRMT", r"PRMT"),
           ("MOV", r"MOV|IMAD\.MOV.*"), ("IMAD", r"IMAD.*"), ("FP32", r"FADD|FMUL|FFMA"),
           ("ialu", r"IADD3|VIADD|ISETP|PLOP3|LEA|SEL|CS2R"), ("uniform", r"U[A-Z0-9]+|S2UR|R2UR"), ("BRA", r"BRA")]


def cls(text):
    op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
    for name, pat in CLASSES:
        if re.fullmatch(pat, op) or re.fullmatch(pat, op.split(".")[0]):
            return name
    return "other"


def listing(cubin, kernel):
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not tool:
        sys.exit("hgmma_sass_loop: no nvdisasm on PATH; set NVDISASM to its path")
    text = subprocess.run([tool, "-hex", "-g", cubin], check=True, capture_output=True, text=True).stdout
    body = text.split(".text." + kernel + ":\n", 1)
    if len(body) < 2:
        sys.exit(f"hgmma_sass_loop: no kernel {kernel} in {cubin}")
    ins, labels, src, pend, label = [], {}, "", None, None
    for line in body[1].split(".section", 1)[0].splitlines():
        if m := re.match(r"(\.L_x_\d+):", line):
            label = m.group(1)
        elif m := re.match(r'\s*//## File "([^"]+)", line (\d+)', line):
            src = f"{os.path.basename(m.group(1))}:{m.group(2)}"
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x([0-9a-f]{16}) \*/", line):
            pend = (int(m.group(1), 16), m.group(2), src)
            if label:
                labels[label], label = pend[0], None
        elif (m := re.match(r"\s*/\* 0x([0-9a-f]{16}) \*/", line)) and pend:
            hi = int(m.group(1), 16)
            ins.append(pend + (dict(stall=hi >> 41 & 15, yld=hi >> 45 & 1, wb=hi >> 46 & 7, rb=hi >> 49 & 7,
                                    wait=hi >> 52 & 63),))
            pend = None
    return ins, labels


def main():
    args = [a for a in sys.argv[1:] if a != "-v"]
    if len(args) != 2:
        sys.exit(__doc__)
    ins, labels = listing(*args)
    back = []
    for a, t, _, _ in ins:
        m = re.search(r"BRA.*`\((\.L_x_\d+)\)", t)
        if m and labels.get(m.group(1), a) < a:
            back.append((a, labels[m.group(1)]))
    if not back:
        sys.exit("hgmma_sass_loop: no loop")
    nh = lambda b: sum(1 for x in ins if b[1] <= x[0] <= b[0] and x[1].startswith("HGMMA"))
    end, head = max(back, key=lambda b: (nh(b), -(b[0] - b[1])))
    loop = [x for x in ins if head <= x[0] <= end]
    c = Counter(cls(t) for _, t, _, _ in loop)
    print(f"{args[1]}\nloop 0x{head:04x}-0x{end:04x}: {len(loop)} instructions, stall sum "
          f"{sum(k['stall'] for *_, k in loop)}")
    print("  ".join(f"{n} {c[n]}" for n in [n for n, _ in CLASSES] + ["other"] if c[n]))
    seg = []
    for i, (a, t, s, k) in enumerate(loop):
        seg.append((a, t, k))
        if cls(t) in ("SYNCS", "WARPGROUP", "BRA") or i == len(loop) - 1:
            print(f"  {seg[0][0]:05x}-{a:05x} {len(seg):3d} ins, stall {sum(x[2]['stall'] for x in seg):4d}  "
                  f"{Counter(cls(x[1]) for x in seg).most_common(3)}  ends {t}")
            seg = []
    if "-v" in sys.argv:
        sb = lambda v: "-" if v == 7 else str(v)
        for a, t, s, k in loop:
            wt = ",".join(str(i) for i in range(6) if k["wait"] >> i & 1) or "-"
            print(f"{a:05x} {k['stall']:2d} {k['yld']} {sb(k['wb']):>1} {sb(k['rb']):>1} {wt:>7}  {t}  [{s}]")


if __name__ == "__main__":
    main()
