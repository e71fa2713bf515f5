"""Snapshot files on the GPU (issue 15): a CUDA session's state saved to a file (downloaded part by
part through the Buffer API) and loaded into another CUDA session (uploaded) continues bit-identically
to the in-memory snapshot; the file keeps the KV cache in the session's bf16; CPU and CUDA files do
not cross-load (fp32 vs bf16 KV cache), with an error that says where to load them."""
from __future__ import annotations

import numpy as np
import pytest

import lily
from lily import SnapshotFileError, snapshot_file
from lily.checkpoint import synthetic

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthetic.make_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", with_tokenizer=False)


def steps(session, ids):
    return np.stack([session.decode_step(t) for t in ids])


@pytest.mark.parametrize("use_graph", [True, False])
def test_cuda_save_load_round_trip_is_exact(tiny, tmp_path, use_graph):
    m = lily.Model.load(tiny, device="cuda", max_context=4096)
    s = m.new_session(use_graph=use_graph)
    prompt = np.random.default_rng(3).integers(0, m.config.vocab_size, 2500).tolist()  # two prefill chunks
    s.prefill(prompt)
    snap = s.snapshot()
    path = snap.save(tmp_path / "cuda.lilysnap")
    header = snapshot_file.read_header(path)
    assert header["device"] == "cuda" and header["position"] == 2500
    kv = [b for b in header["blobs"] if b["name"].endswith(("k_cache", "v_cache"))]
    assert kv and all(b["dtype"] == "BF16" and b["shape"][0] == 2500 for b in kv)
    cont = [5, 6, 7, 8, 9, 10, 11, 12]
    memory = m.new_session(use_graph=use_graph)
    memory.restore(snap)
    from_file = m.new_session(use_graph=use_graph)
    from_file.restore(path)
    assert from_file.tokens == memory.tokens == tuple(prompt)
    mem_state, file_state = memory.state(), from_file.state()
    for k in mem_state:
        np.testing.assert_array_equal(file_state[k], mem_state[k], err_msg=k)
    np.testing.assert_array_equal(steps(from_file, cont), steps(memory, cont))
    # A loaded snapshot also restores the session that saved it, after it wandered off.
    s.prefill([1, 2, 3])
    s.restore(m.load_snapshot(path))
    np.testing.assert_array_equal(steps(s, cont), steps(_fresh(m, snap, use_graph), cont))
    # Sampled generation on the device continues identically too.
    a = m.generate(prompt + [4], max_tokens=8, temperature=0.8, seed=1, session=_fresh(m, snap, use_graph))
    g = m.new_session(use_graph=use_graph)
    g.restore(path)
    b = m.generate(prompt + [4], max_tokens=8, temperature=0.8, seed=1, session=g)
    assert a.token_ids == b.token_ids


def _fresh(m, snap, use_graph):
    s = m.new_session(use_graph=use_graph)
    s.restore(snap)
    return s


def test_cpu_and_cuda_files_do_not_cross_load(tiny, tmp_path):
    gpu = lily.Model.load(tiny, device="cuda", max_context=256)
    cpu = lily.Model.load(tiny, device="cpu", max_context=256)
    ids = list(range(10, 40))
    for src, dst, name in ((gpu, cpu, "cuda"), (cpu, gpu, "cpu")):
        s = src.new_session()
        s.prefill(ids)
        path = s.snapshot().save(tmp_path / f"{name}.lilysnap")
        with pytest.raises(SnapshotFileError, match=f"saved from a {name} session.*Load it into a {name} session"):
            dst.new_session().restore(path)
        t = src.new_session()  # the same device loads it
        t.restore(path)
        assert t.position == 30
