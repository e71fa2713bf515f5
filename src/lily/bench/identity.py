"""Hardware and software identity of a benchmark run, and the checkpoint's hash.

Every probe degrades to None where its tool is missing (no GPU, no nvcc, no git), so the same code
runs on a CPU-only CI machine and on the GPU host.

Checkpoint hash: the sha256 of each file of the checkpoint folder (what `sha256sum` prints, files
hashed in parallel threads), and one folder digest: sha256 over the lines "<sha256>  <name>\\n" of
all files in sorted name order (the output of `cd CKPT && sha256sum $(ls | sort)`).

Source identity: the git commit (and whether tracked files differ from it) where the source tree
is a git checkout, else $LILY_COMMIT; plus a source-tree digest over src/, csrc/, CMakeLists.txt and
pyproject.toml, which identifies the exact code that ran even where the copy has no .git.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

HASH_BLOCK = 8 << 20
SOURCE_PARTS = ("src", "csrc", "CMakeLists.txt", "pyproject.toml")
SKIP_SUFFIXES = (".pyc", ".so", ".pyd", ".dylib", ".o")


def _run(cmd: list[str], cwd: str | Path | None = None, timeout: float = 20) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)  # hashlib releases the GIL on large buffers: threads hash in parallel
    return h.hexdigest()


def checkpoint_hash(path: str | Path, workers: int | None = None) -> dict:
    """{"sha256": folder digest, "bytes": total size, "files": {name: sha256}} of every regular file
    directly in the folder (hidden files skipped)."""
    root = Path(path)
    names = sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    workers = workers or min(len(names), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = dict(zip(names, pool.map(lambda n: file_sha256(root / n), names)))
    folder = hashlib.sha256("".join(f"{digests[n]}  {n}\n" for n in names).encode()).hexdigest()
    return {"path": str(root.resolve()), "sha256": folder, "bytes": sum((root / n).stat().st_size for n in names),
            "files": digests}


def source_root() -> Path | None:
    """The lily source tree: $LILY_SOURCE_DIR, else the folder above src/lily when lily runs from
    its source (editable install)."""
    env = os.environ.get("LILY_SOURCE_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[3]  # src/lily/bench/identity.py -> repo root
    return here if (here / "pyproject.toml").is_file() and (here / "src" / "lily").is_dir() else None


def source_tree_hash(root: str | Path) -> str | None:
    """sha256 over "<sha256>  <relative path>\\n" of the source files (sorted), caches and binaries skipped."""
    root = Path(root)
    files = []
    for part in SOURCE_PARTS:
        p = root / part
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts
                         and not f.name.endswith(SKIP_SUFFIXES) and not any(s.endswith(".egg-info") for s in f.parts))
    if not files:
        return None
    rel = sorted((f.relative_to(root).as_posix(), f) for f in files)
    return hashlib.sha256("".join(f"{file_sha256(f)}  {name}\n" for name, f in rel).encode()).hexdigest()


def git_info(root: Path | None) -> dict:
    out: dict = {"commit": None, "dirty": None, "source": None}
    if root is not None and (root / ".git").exists():
        commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
        if commit:
            status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
            out.update(commit=commit.strip(), dirty=bool(status and status.strip()), source="git")
    if out["commit"] is None and os.environ.get("LILY_COMMIT"):
        out.update(commit=os.environ["LILY_COMMIT"], source="LILY_COMMIT")
    return out


def gpu_info() -> dict:
    """GPU name, driver, memory, the driver's CUDA version (nvidia-smi) and the toolkit's (nvcc)."""
    info: dict = {"gpus": [], "driver": None, "cuda_driver": None, "cuda_toolkit": None}
    q = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,pci.bus_id",
              "--format=csv,noheader"])
    if q:
        for line in q.strip().splitlines():
            parts = [s.strip() for s in line.split(",")]
            if len(parts) >= 5:
                info["gpus"].append({"name": parts[0], "driver": parts[1], "memory": parts[2],
                                     "max_sm_clock": parts[3], "pci_bus_id": parts[4]})
        info["driver"] = info["gpus"][0]["driver"] if info["gpus"] else None
    header = _run(["nvidia-smi"])
    if header and (m := re.search(r"CUDA Version:\s*([\d.]+)", header)):
        info["cuda_driver"] = m.group(1)
    nvcc = _run(["nvcc", "--version"])
    if nvcc and (m := re.search(r"release ([\d.]+), V([\d.]+)", nvcc)):
        info["cuda_toolkit"] = m.group(2)
    info["gpu"] = info["gpus"][0]["name"] if info["gpus"] else None
    return info


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def package_versions(names=("numpy", "torch", "transformers", "matplotlib", "mlx", "mlx-cuda-13", "mlx-cpu",
                            "mlx-lm", "nanobind", "scikit-build-core")) -> dict:
    """Installed distribution versions (read from metadata: nothing is imported)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def lily_build() -> dict:
    import lily
    from lily import _core

    return {"version": lily.__version__, "path": str(Path(lily.__file__).parent),
            "cuda_backend": bool(_core.backend_available("cuda"))}


def identity(model: str | Path | None = None, *, hash_checkpoint: bool = True, workers: int | None = None) -> dict:
    """Everything that identifies a run: when, where, which code, which checkpoint."""
    root = source_root()
    src_hash = source_tree_hash(root) if root is not None else None
    ident = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        **gpu_info(),
        "lily": {**lily_build(), **git_info(root), "source_tree_sha256": src_hash},
        "packages": package_versions(),
    }
    if model is not None:
        ident["checkpoint"] = checkpoint_hash(model, workers) if hash_checkpoint else {"path": str(Path(model).resolve())}
    return ident
