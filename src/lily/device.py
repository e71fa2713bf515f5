"""Which device a model runs on: the name a user gives ('auto', 'cpu', 'cuda', 'metal') -> a backend
this build of lily has."""
from __future__ import annotations

from . import _core
from .errors import DeviceError


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when this build has a usable CUDA backend, else 'cpu'."""
    if device not in ("auto", "cpu", "cuda", "metal"):
        raise DeviceError(f"unknown device {device!r} (expected 'auto', 'cpu', 'cuda' or 'metal')")
    if device == "auto":
        return "cuda" if _core.backend_available("cuda") else "cpu"
    if not _core.backend_available(device):
        raise DeviceError(f"device {device!r} is not available: this build of lily has no {device} backend "
                          f"or no such device is present (use device='cpu' or 'auto')")
    return device
