"""Shared fixtures of the test suite (helpers and the tolerance table live in checks.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Under pytest-xdist (README's command runs `-n auto`, pyproject's addopts) each worker gets its share
# of the cores for OpenMP (lily's CPU ops, torch) and BLAS, set before numpy, torch or lily load: two
# workers with two spinning OpenMP threads each on 2 cores ran the suite slower than one process did.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = str(max(1, _cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _share)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # checks.py, hf_reference.py


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core this process may run on (taskset and cgroups' affinity count,
    unlike os.cpu_count), at most 8 (each worker holds its own models, about 1 GiB)."""
    return min(_cpus(), 8)


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
