"""The C++ core's includes go one way, the analogue of test_import_graph.py for csrc/. Built from the
source: every ``#include "..."`` line counts, also one under ``#ifdef`` (check.h's CUDA dispatch).

The layers, lowest first (docs/architecture.md, "C++ file layout"):

    runtime/            the device runtime: Buffer and Tensor, the backend services (device_api.h)
                        and their dispatch, the CUDA stream and launch helpers, profiling spans
    ops/ cpu/ cuda/     the ops: the contract and its checked entries (ops/), the backends (cpu/, cuda/)
    engine/             the model: config, tensor table, weights, the forward pass, sessions
    bindings/           the Python module

A file may include files of its own layer or a lower one, never a higher one. Inside the ops layer the
contract (ops/ops.h, ops/weights.h) includes only the runtime, and the two backends do not include
each other; inside the engine the engine does not include the session (a session hands the engine a
ForwardContext). No file includes itself through others (Tarjan, shared with test_import_graph.py).

Run as a script (``python tests/test_include_graph.py``) it prints every violation.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from test_import_graph import cycles  # the strongly connected components of a graph

CSRC = Path(__file__).resolve().parent.parent / "csrc"
LAYERS = {"runtime": 0, "ops": 1, "cpu": 1, "cuda": 1, "engine": 2, "bindings": 3}
SOURCES = (".h", ".cpp", ".cu", ".cuh")
CONTRACT = ("ops/ops.h", "ops/weights.h")  # the ops' contract: includes only the runtime
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def include_graph() -> dict[str, list[str]]:
    """{file: [included files]}, paths relative to csrc/ (quoted includes resolve next to the file,
    then from csrc/, as the build's -I csrc does)."""
    graph = {}
    for path in sorted(p for p in CSRC.rglob("*") if p.suffix in SOURCES):
        deps = []
        for name in INCLUDE.findall(path.read_text()):
            for candidate in (path.parent / name, CSRC / name):
                if candidate.resolve().is_file():
                    deps.append(candidate.resolve().relative_to(CSRC).as_posix())
                    break
            else:
                raise AssertionError(f"{path.relative_to(CSRC)}: #include \"{name}\" names no file")
        graph[path.relative_to(CSRC).as_posix()] = deps
    return graph


def layer(name: str) -> str:
    return name.split("/")[0]


def violations(graph: dict[str, list[str]]) -> list[str]:
    out = []
    for f, deps in graph.items():
        if layer(f) not in LAYERS:
            out.append(f"{f}: folder {layer(f)}/ has no layer (add it to LAYERS and docs/architecture.md)")
            continue
        for d in deps:
            if layer(d) not in LAYERS:
                continue  # reported as a file of its own
            if LAYERS[layer(d)] > LAYERS[layer(f)]:
                out.append(f"{f} includes {d}: {layer(f)}/ is below {layer(d)}/")
            if {layer(f), layer(d)} == {"cpu", "cuda"}:
                out.append(f"{f} includes {d}: the backends do not include each other")
            if f in CONTRACT and layer(d) != "runtime" and d not in CONTRACT:
                out.append(f"{f} includes {d}: the op contract includes only the runtime")
            if f in ("engine/engine.h", "engine/engine.cpp") and d == "engine/session.h":
                out.append(f"{f} includes {d}: the engine sees a session only as a ForwardContext")
    return out + [f"include cycle: {' -> '.join(c)}" for c in cycles(graph)]


def test_the_graph_sees_includes():
    graph = include_graph()
    assert "runtime/tensor.h" in graph["ops/ops.h"]                       # "../runtime/tensor.h"
    assert "cuda/cuda_ops.h" in graph["ops/check.h"]                      # under #ifdef LILY_WITH_CUDA
    assert "runtime/common.h" in graph["cuda/kernels/linear_common.cuh"]  # two levels up
    assert "cuda/kernels/common.cuh" in graph["cuda/kernels/norms.cuh"]   # next to the file
    assert "engine/forward.h" in graph["engine/engine.h"]


def test_the_check_sees_violations():
    graph = include_graph()
    bad = {**graph, "runtime/tensor.h": graph["runtime/tensor.h"] + ["ops/ops.h"],
           "cpu/cpu_ops.h": graph["cpu/cpu_ops.h"] + ["cuda/cuda_ops.h"],
           "ops/weights.h": graph["ops/weights.h"] + ["engine/config.h"],
           "engine/engine.cpp": graph["engine/engine.cpp"] + ["engine/session.h"]}
    found = "\n".join(violations(bad))
    assert "runtime/tensor.h includes ops/ops.h: runtime/ is below ops/" in found
    assert "the backends do not include each other" in found
    assert "ops/weights.h includes engine/config.h" in found
    assert "the engine sees a session only as a ForwardContext" in found
    assert "include cycle" in found  # tensor.h -> ops.h -> tensor.h


def test_includes_go_one_way():
    found = violations(include_graph())
    assert not found, "\n".join(found)


if __name__ == "__main__":
    found = violations(include_graph())
    print("\n".join(found) or "csrc includes go one way")
    sys.exit(1 if found else 0)
