"""Shared fixtures of the test suite (helpers and the tolerance table live in checks.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # checks.py, hf_reference.py


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip when this build or machine has no usable CUDA device, never otherwise."""
    from lily import _core

    if _core.backend_available("cuda"):
        return
    skip = pytest.mark.skip(reason="no CUDA device (or lily built without CUDA)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory):
    os.environ.setdefault("LILY_CACHE_DIR", str(tmp_path_factory.mktemp("lily-cache")))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
