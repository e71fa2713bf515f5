"""Shared checks of the test suite: the CPU tolerance table and comparison helpers. A module of its
own name (not conftest) so that `from checks import ...` is unambiguous next to tests/gpu/conftest.py."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

# Logit tolerance of the fp32 CPU backend against transformers in fp32, as a fraction of the
# largest reference logit. Both sides compute in fp32 but sum in different orders (blocked GEMMs
# vs sequential dots) and run the GDN recurrence in different forms (transformers' 64-token
# chunked WY form in prefill vs lily's token-by-token form); an independent fp64 implementation of
# the equations (docs/model.md) saw 6e-5 in prefill. 1e-3 leaves room for that through 8 layers without hiding a wrong equation,
# which moves logits by O(1).
TOL = {"cpu_vs_hf_fp32": 1e-3}


def read_dir(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of a checkpoint folder: name -> (safetensors dtype, array in storage dtype)."""
    from lily.checkpoint.safetensors_io import SafetensorsFile

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        f = SafetensorsFile(file)
        out.update({n: (f.info(n).dtype, f.get(n)) for n in f.names()})
    return out


def assert_logits_close(ours: np.ndarray, ref: np.ndarray, rel: float) -> None:
    """Max |diff| within rel * max|ref|, and the same argmax wherever the reference top-2 are apart."""
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(ours - ref).max())
    assert err <= rel * scale, f"max |dlogit| {err:.3g} > {rel * scale:.3g}"
    top2 = np.sort(ref, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 10 * err
    assert (ours.argmax(-1) == ref.argmax(-1))[clear].all()


def rel_err(a, ref) -> float:
    """||a - ref|| / ||ref|| in fp64 (the GPU-vs-CPU comparisons' measure)."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_rel_close(name: str, got, ref, tol: float) -> None:
    """Same shape and rel_err(got, ref) <= tol, with the max abs difference in the message."""
    assert got.shape == ref.shape, name
    err, max_abs = rel_err(got, ref), float(np.abs(got - ref).max())
    assert err <= tol, f"{name}: rel err {err:.3g} > {tol:.3g} (max abs {max_abs:.3g})"


def token_mask(vocab_size: int, allowed_ids) -> tuple[np.ndarray, np.ndarray]:
    """(allowed [V] bool, the sampler's mask: int32 words, bit v of the little-endian bit string = id v)."""
    allowed = np.zeros(vocab_size, bool)
    allowed[list(allowed_ids)] = True
    bits = np.zeros((vocab_size + 31) // 32 * 32, np.uint8)
    bits[:vocab_size] = allowed
    return allowed, np.packbits(bits, bitorder="little").view(np.int32)


def nan_norm_checkpoint(dest: Path) -> Path:
    """A copy of the built-in tiny checkpoint at `dest` whose final norm weight is all NaN: the model
    loads (with check_weights=False) and every logit it computes is NaN."""
    import shutil

    from lily.checkpoint.safetensors_io import SafetensorsFile, save_file
    from lily.checkpoint.tiny import tiny_checkpoint

    shutil.copytree(tiny_checkpoint(), dest)
    f = SafetensorsFile(dest / "model.safetensors")
    tensors = {n: (f.info(n).dtype, np.array(f.get(n))) for n in f.names()}
    f.close()
    name = next(n for n in tensors if n.endswith("model.norm.weight"))
    dtype, a = tensors[name]
    a[...] = 0x7FC0 if dtype == "BF16" else np.nan
    save_file(dest / "model.safetensors", tensors)
    return dest


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height and holds almost no pixel data (a decompression bomb's
    shape without its bytes)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def run_emulator(tmp_path: Path, name: str, *flags: str) -> str:
    """Builds tests/emu/<name>.cu with nvcc (host code only: it runs without a GPU; `flags` such as
    -arch=sm_90a for headers with Hopper instructions), runs it, asserts it exits 0 saying "all passed",
    and returns its output (the callers count their "ok" lines)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / name
    subprocess.run(["nvcc", "-O2", "-std=c++17", *flags, "--expt-relaxed-constexpr", "-I", str(root / "csrc"), "-o",
                    str(exe), str(root / "tests/emu" / f"{name}.cu")], check=True, capture_output=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    return r.stdout

