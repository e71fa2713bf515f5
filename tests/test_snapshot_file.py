"""Snapshot files (issue 15): Snapshot.save / Model.load_snapshot / Session.restore(path) on the CPU.
A state loaded from a file continues bit-identically to the in-memory snapshot it was saved from;
every malformed, foreign or oversized file is refused with a LilyError naming the problem."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import lily
from lily import LilyError, SnapshotFileError, snapshot_file
from lily.checkpoint import synthetic
from lily.checkpoint.tiny import tiny_checkpoint

CONTEXT = 256


@pytest.fixture(scope="module")
def model() -> lily.Model:
    # prefill_chunk 16: a 70-token prompt runs in several chunks
    return lily.Model.load(tiny_checkpoint(), device="cpu", max_context=CONTEXT, prefill_chunk=16)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """(path, in-memory snapshot, prompt) of a 70-token prefill."""
    s = model.new_session()
    prompt = np.random.default_rng(5).integers(0, model.config.vocab_size, 70).tolist()
    s.prefill(prompt)
    snap = s.snapshot()
    path = tmp_path_factory.mktemp("snap") / "chat.lilysnap"
    assert snap.save(path) == path
    return path, snap, prompt


def decode(session, first: int, n: int) -> tuple[list[int], np.ndarray]:
    """n greedy steps from `first`: the ids fed and the logits of every step."""
    ids, rows, t = [], [], first
    for _ in range(n):
        ids.append(t)
        logits = session.decode_step(t)
        rows.append(logits)
        t = int(np.argmax(logits))
    return ids, np.stack(rows)


def states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_restore_from_file_continues_exactly_like_the_in_memory_snapshot(model, saved):
    path, snap, prompt = saved
    memory, from_file = model.new_session(), model.new_session()
    memory.restore(snap)
    from_file.restore(path)
    assert from_file.position == memory.position == 70 and from_file.tokens == memory.tokens == tuple(prompt)
    states_equal(from_file.state(), memory.state())
    a_ids, a = decode(memory, 7, 12)
    b_ids, b = decode(from_file, 7, 12)
    assert a_ids == b_ids
    np.testing.assert_array_equal(a, b)
    # Model.load_snapshot gives a Snapshot like any other: it restores any session, repeatedly.
    loaded = model.load_snapshot(path)
    assert (loaded.position, loaded.tokens, loaded.nbytes, loaded.device) == (70, snap.tokens, snap.nbytes, "cpu")
    for _ in range(2):
        from_file.restore(loaded)
        np.testing.assert_array_equal(decode(from_file, 7, 12)[1], a)
    # Generation resumes from the restored tokens (only the new part is prefilled) with the same result.
    g = model.new_session()
    g.restore(path)
    more = prompt + [11, 12, 13]
    assert g.generate(more, max_tokens=6).token_ids == \
        model.generate(more, max_tokens=6, session=model.new_session()).token_ids


def test_round_trips_of_empty_and_full_sessions(model, tmp_path):
    s = model.new_session(max_context=40)
    empty = tmp_path / "empty.lilysnap"
    s.snapshot().save(empty)
    s.prefill(list(range(1, 41)))  # full
    full = tmp_path / "full.lilysnap"
    s.snapshot().save(full)
    t = model.new_session(max_context=40)
    t.restore(full)
    states_equal(t.state(), s.state())
    t.restore(empty)
    assert t.position == 0 and t.tokens == ()
    states_equal(t.state(), model.new_session(max_context=40).state())
    # Saving again over a file replaces it whole; no temporary file is left behind.
    s.reset()
    s.snapshot().save(full)
    assert model.load_snapshot(full).position == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.lilysnap", "full.lilysnap"]


def test_file_layout(model, saved):
    path, snap, prompt = saved
    raw = path.read_bytes()
    magic, version, flags, header_len = struct.unpack("<8sIIQ", raw[:24])
    assert (magic, version, flags) == (b"LILYSNAP", 1, 0)
    header = json.loads(raw[24:24 + header_len])
    data_start = 24 + header_len
    assert data_start % 64 == 0 and len(raw) == data_start + header["data_size"]
    assert header["position"] == 70 and header["device"] == "cpu"
    assert header["model"]["config"]["hidden_size"] == model.config.hidden_size
    names = [b["name"] for b in header["blobs"]]
    assert names[0] == "tokens" and names[1:] == list(model.new_session().state())
    tok = header["blobs"][0]
    assert np.frombuffer(raw[data_start + tok["offset"]:][:tok["nbytes"]], "<i4").tolist() == prompt
    state = model.new_session()
    state.restore(snap)
    for b in header["blobs"][1:]:  # the raw blobs are the state, little-endian float32 on the CPU
        assert b["dtype"] == "F32" and b["offset"] % 64 == 0
        blob = np.frombuffer(raw[data_start + b["offset"]:][:b["nbytes"]], "<f4").reshape(b["shape"])
        np.testing.assert_array_equal(blob, state.state()[b["name"]])
    info = snapshot_file.read_header(path)  # no model needed to read it
    assert info["position"] == 70 and info["data_start"] == data_start


def rewrite_header(path, out, change):
    """Copy a snapshot file with its header changed by `change(header)` (data realigned)."""
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[16:24])[0]
    header = json.loads(raw[24:24 + header_len])
    data = raw[24 + header_len:]
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-(24 + len(text)) % 64)
    out.write_bytes(raw[:16] + struct.pack("<Q", len(text)) + text + data)
    return out


def test_refusals_name_the_problem(model, saved, tmp_path):
    path, snap, _ = saved
    raw = path.read_bytes()
    s = model.new_session()

    def refused(data_or_path, match, session=s):
        p = data_or_path
        if isinstance(data_or_path, bytes):
            p = tmp_path / "bad.lilysnap"
            p.write_bytes(data_or_path)
        with pytest.raises(SnapshotFileError, match=match):
            session.restore(p)
        assert session.position == 0  # nothing changed

    refused(tmp_path / "missing.lilysnap", "no such snapshot file")
    refused(tmp_path, "is a folder")
    refused(b"PK\x03\x04" + raw[4:], r"not a lily snapshot file \(starts with b'PK")
    refused(b"", "not a lily snapshot file")
    refused(raw[:5], "truncated")
    refused(raw[:8] + struct.pack("<I", 2) + raw[12:], "format version 2 is not supported.*upgrade lily")
    refused(raw[:100], r"truncated snapshot file \(100 bytes, the header alone needs")
    refused(raw[:-1], rf"truncated snapshot file \({len(raw) - 1} bytes, expected {len(raw)}\)")
    refused(raw[:len(raw) // 2], "truncated")
    flipped = bytearray(raw)
    flipped[-10] ^= 1
    refused(bytes(flipped), r"corrupt snapshot file \(checksum of layers\.\d+\.\w+ does not match\)")
    refused(raw[:24] + b"[" + raw[25:], "corrupt snapshot header")
    # Another model: another config, or the same config with other weights.
    refused(rewrite_header(path, tmp_path / "cfg.lilysnap", lambda h: (
        h["model"].update(config_sha256="0" * 64), h["model"]["config"].update(hidden_size=4096))),
        "saved from another model \\(config differs: hidden_size 4096 vs 128")
    other = lily.Model.load(synthetic.make_checkpoint(tmp_path / "seed1", "tiny", seed=1, with_tokenizer=False),
                            device="cpu", max_context=CONTEXT)
    refused(path, "saved from another model \\(same config, different weights", session=other.new_session())
    # A state kept in other dtypes (a CUDA session's bf16 KV cache).
    def to_cuda(h):
        h["device"] = "cuda"
        for b in h["blobs"]:
            if b["name"].endswith(("k_cache", "v_cache")):
                b["dtype"] = "BF16"
    refused(rewrite_header(path, tmp_path / "cuda.lilysnap", to_cuda),
            "saved from a cuda session, which keeps layers.3.k_cache in BF16; a cpu session keeps it in F32. "
            "Load it into a cuda session")
    # More tokens than the session holds: refused before anything is allocated.
    refused(path, "holds 70 tokens but this session's max_context is 64", session=model.new_session(max_context=64))
    (tmp_path / "notes.txt").write_text("not a snapshot at all, but long enough")
    with pytest.raises(SnapshotFileError, match="notes.txt: not a lily snapshot"):
        model.load_snapshot(tmp_path / "notes.txt")
    assert issubclass(SnapshotFileError, LilyError)


def test_a_failed_save_leaves_the_old_file_and_no_temporary(model, saved, tmp_path):
    path, snap, _ = saved
    dest = tmp_path / "keep.lilysnap"
    dest.write_bytes(path.read_bytes())
    s = model.new_session()
    s.prefill([1, 2, 3])
    fresh = s.snapshot()
    core = fresh._core

    class Failing:
        def __getattr__(self, name):
            return getattr(core, name)

        def read(self, *args):
            raise LilyError("device read failed")

    fresh._core = Failing()
    with pytest.raises(LilyError, match="device read failed"):
        fresh.save(dest)
    assert dest.read_bytes() == path.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["keep.lilysnap"]
    with pytest.raises(SnapshotFileError, match="could not write"):
        snap.save(tmp_path / "no" / "such" / "dir.lilysnap")
    with pytest.raises(SnapshotFileError, match="is a folder"):
        snap.save(tmp_path)


def test_save_needs_the_open_model(tmp_path):
    m = lily.Model.load(tiny_checkpoint(), device="cpu", max_context=32)
    s = m.new_session()
    s.prefill([1, 2])
    snap = s.snapshot()
    snap.save(tmp_path / "a.lilysnap")
    m.close()
    with pytest.raises(SnapshotFileError, match="closed or gone"):
        snap.save(tmp_path / "b.lilysnap")
    with pytest.raises(LilyError, match="closed"):
        m.load_snapshot(tmp_path / "a.lilysnap")
