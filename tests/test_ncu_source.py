"""benchmarks/ncu_source.py on a small source-page CSV of ncu's shape: stall shares, opcode shares, the top
instruction, an address range and buckets; and a clear error for a file that is not such a page."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [
    ["0x7f0000a7400", "@P0   BRA 0x7f0000a7600", "10", "10", "100", "9", "1", "9"],
    ["0x7f0000a7410", "LDG.E.U16.CONSTANT R12, desc[UR24][R12.64]", "20", "20", "100", "0", "20", "0"],
    ["0x7f0000a75f0", "PRMT R199, R168, 0x5410, R171", "70", "60", "100", "60", "10", "60"],
]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ncu_source.py"), *args], capture_output=True,
                          text=True, timeout=60)


def test_ncu_source_summary(tmp_path):
    path = tmp_path / "src.csv"
    lines = ['"Kernel Name","k"'] + [",".join(f'"{v}"' for v in r) for r in [HEADER, *ROWS]]
    path.write_text("\n".join(lines) + "\n")
    r = run(str(path), "--top", "1", "--range", "a7400", "a7410", "--buckets", "100")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "samples 100, instructions executed 300" in out
    assert "stall reasons: long_sb 69.0%, wait 31.0%" in out  # 69 of the 100 reason samples
    assert "| PRMT | 70.0% | 33.3% |" in out
    top = out.split("top instructions")[1].splitlines()[1]
    assert "70.0%" in top and "PRMT" in top and "long_sb:60.0%" in top
    listing = [l for l in out.splitlines() if l.startswith(("a7400", "a7410", "a75f0"))]
    assert [l.split()[0] for l in listing] == ["a7400", "a7410"]  # the range, not the PRMT at a75f0
    assert "  a7400  30.0%" in out and "  a7500  70.0%" in out  # 0x100-byte buckets


def test_ncu_source_refuses_other_files(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    r = run(str(path))
    assert r.returncode != 0 and "no 'Address' header row" in r.stderr
