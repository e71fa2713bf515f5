"""Hardware counters of one launch of one lily kernel, by Nsight Compute (`ncu`, in the GPU host's CUDA
toolkit): the kernel's SOL throughputs, warp stall reasons, issue-slot use, L1/L2/HBM traffic, for the
question a profile's timings cannot answer (what bounds a kernel). It runs `ncu` on itself: the target is
one prefill of `--context` tokens (`--decode N`: then N decode steps, whose graph nodes ncu profiles one by
one) on `--model`, and ncu catches launch `--skip` of the kernels whose demangled name matches `--kernel`.

    python3 benchmarks/ncu_kernel.py --model CKPT --kernel 'linear_wgmma_tma_kernel<\\(int\\)128, \\(bool\\)0, \\(bool\\)1' \\
        --out ncu_gated.txt

ncu writes template arguments as `(int)128, (bool)0`: escape the parentheses in the regex. Without a match ncu
prints the names it saw ("Available Kernels"). `--set full` replays the launch ~40 times (a few seconds for a
0.5 ms kernel); `--set basic` is quicker. `--count N` profiles N matching launches from `--skip` on (a layer's
several products of one instance, told apart by their grid sizes in the report). `--page raw` prints every
metric by name instead of the sections: the warp stall reasons are the
`smsp__average_warps_issue_stalled_*_per_issue_active.ratio` lines (grep "issue_stalled"). `--page source`
writes the SASS with per-instruction counters as CSV (executed instructions, warp stall samples by reason):
which instruction the warps wait at.
"""

from __future__ import annotations

import argparse
import shutil
import os
import subprocess
import sys
import tempfile

import numpy as np


def target(model_path: str, context: int, decode: int, chunk: int, sampling: str) -> None:
    import lily
    from bench_engine import parse_sampling  # (benchmarks/ is this script's directory, first on sys.path)

    model = lily.Model.load(model_path, device="cuda", max_context=8, prefill_chunk=chunk)
    session = model.new_session(max_context=context + decode + 8)
    ids = ((np.arange(context, dtype=np.int64) * 2654435761) % 2**32 % model.config.vocab_size).astype(np.int32)
    core = session._core
    core.set_sampler(**parse_sampling(sampling))
    core.prefill_sample(ids)
    for _ in range(decode):
        core.decode_sample(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="checkpoint directory (on the GPU host: the one host_lib.sh's host_full_checkpoint writes)")
    ap.add_argument("--kernel", help="regex on the demangled kernel name")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--decode", type=int, default=0, help="decode steps after the prompt (default 0)")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (default 8192, the CUDA default)")
    ap.add_argument("--skip", type=int, default=0, help="matching launches to skip before the profiled one")
    ap.add_argument("--count", type=int, default=1, help="matching launches to profile (default 1)")
    ap.add_argument("--sampling", default="", help="the sampler as bench_engine.py's key=value pairs (default greedy): "
                    "with --kernel sample_kernel, what top_k / top_p cost")
    ap.add_argument("--page", default="details", choices=["details", "raw", "source"], help="ncu's report page")
    ap.add_argument("--set", default="full", help="ncu section set (full, detailed, basic)")
    ap.add_argument("--out", help="write ncu's report text here (default: stdout)")
    ap.add_argument("--run", action="store_true", help=argparse.SUPPRESS)  # ncu's target: do the model work
    a = ap.parse_args()
    if a.run:
        return target(a.model, a.context, a.decode, a.chunk, a.sampling)
    if not a.kernel:
        ap.error("--kernel is required")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    details = ["--print-details", "all"] if a.page == "details" else []
    tmp = tempfile.TemporaryDirectory()
    report = os.path.join(tmp.name, "report")  # the source page is printed from a saved report
    page = ["-o", report] if a.page == "source" else ["--page", a.page, *details]
    cmd = [ncu, "--set", a.set, *page, "--kernel-name-base", "demangled",
           "--kernel-name", f"regex:{a.kernel}", "--launch-skip", str(a.skip), "--launch-count", str(a.count),
           sys.executable, __file__, "--run", "--model", a.model, "--context", str(a.context),
           "--decode", str(a.decode), "--chunk", str(a.chunk), "--sampling", a.sampling]
    out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if a.page == "source" and out.returncode == 0:
        out = subprocess.run([ncu, "--import", report + ".ncu-rep", "--page", "source", "--print-source", "sass",
                              "--csv"], capture_output=True, text=True)
        text = out.stdout + out.stderr
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        print(text)
    if out.returncode != 0 or "No kernels were profiled" in text:
        sys.exit(f"ncu_kernel: no report (rc {out.returncode}); see {a.out or 'the output above'}")


if __name__ == "__main__":
    main()
