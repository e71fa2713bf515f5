"""Recurrence invariants of the CPU backend: prefill(T) = T decode steps, chunked = one-shot,
snapshot/restore resumes exactly, bad input leaves the session untouched.

Every CPU op computes each token's row independently of how many rows share the call (one
dequantized weight row dotted with each input row; the GDN scan is token by token), so these
equalities are exact, not approximate."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import lily
from hf_reference import build_model, save_hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(build_model(seed=3), tmp_path_factory.mktemp("hf-session"))


@pytest.fixture(scope="module")
def model(ckpt):
    return lily.Model.load(ckpt, device="cpu", max_context=512, prefill_chunk=32)


def states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_prefill_equals_decode_steps(model, rng):
    ids = rng.integers(0, model.config.vocab_size, 75).tolist()
    s1, s2 = model.new_session(), model.new_session()
    last = s1.prefill(ids)
    for t in ids:
        step = s2.decode_step(t)
    np.testing.assert_array_equal(last, step)
    states_equal(s1.state(), s2.state())
    assert s1.position == s2.position == 75


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(1, 80), n=st.integers(1, 90))
def test_chunked_prefill_equals_one_shot(ckpt, chunk, n):
    ids = np.random.default_rng(n).integers(0, 313, n)
    one = lily.Model.load(ckpt, device="cpu", max_context=128, prefill_chunk=128)
    many = lily.Model.load(ckpt, device="cpu", max_context=128, prefill_chunk=chunk)
    np.testing.assert_array_equal(one.prefill(ids, all_logits=True), many.prefill(ids, all_logits=True))
    states_equal(one.session.state(), many.session.state())


def test_all_logits_rows_match_last(model, rng):
    ids = rng.integers(0, 313, 40)
    every = model.prefill(ids, all_logits=True)
    assert every.shape == (40, model.config.vocab_size)
    np.testing.assert_array_equal(every[-1], model.prefill(ids))


def test_snapshot_restore_resumes_exactly(model, rng):
    s = model.new_session()
    s.prefill(rng.integers(0, 313, 50))
    snap = s.snapshot()
    assert snap.position == 50 and snap.nbytes > 0
    cont = rng.integers(0, 313, 6).tolist()
    first = [s.decode_step(t) for t in cont]
    s.prefill(rng.integers(0, 313, 20))  # wander off
    s.restore(snap)
    assert s.position == 50
    again = [s.decode_step(t) for t in cont]
    np.testing.assert_array_equal(np.stack(first), np.stack(again))
    other = model.new_session()  # a snapshot also seeds another session
    other.restore(snap)
    np.testing.assert_array_equal(other.decode_step(cont[0]), first[0])


def test_snapshot_rejects_other_model(model, ckpt):
    other = lily.Model.load(ckpt, device="cpu", max_context=64)
    with pytest.raises(lily.LilyError, match="another model"):
        other.new_session().restore(model.new_session().snapshot())
    with pytest.raises(lily.LilyError, match="Snapshot"):
        model.new_session().restore("not a snapshot")


def test_reset_forgets(model, rng):
    ids = rng.integers(0, 313, 10)
    s = model.new_session()
    a = s.prefill(ids)
    s.prefill(rng.integers(0, 313, 5))
    s.reset()
    assert s.position == 0
    np.testing.assert_array_equal(s.prefill(ids), a)


@pytest.mark.parametrize("bad, match", [
    ([1, 2, 313], "313 at index 2 is outside the vocabulary"),
    ([-1], "-1 at index 0"),
    ([], "non-empty"),
    ([1.5, 2.0], "integers"),
    ([[1, 2]], "1-D"),
])
def test_bad_token_ids_rejected_and_state_kept(model, bad, match):
    s = model.new_session()
    s.prefill([5, 6, 7])
    before = s.state()
    with pytest.raises(lily.LilyError, match=match):
        s.prefill(bad)
    assert s.position == 3
    states_equal(before, s.state())


def test_bad_decode_token(model):
    s = model.new_session()
    for bad in (313, -5, 2**40):
        with pytest.raises(lily.LilyError, match="outside the vocabulary"):
            s.decode_step(bad)
    with pytest.raises(lily.LilyError, match="integer"):
        s.decode_step(1.0)
    assert s.position == 0


def test_context_overflow(model):
    s = model.new_session(max_context=16)
    s.prefill(list(range(10)))
    with pytest.raises(lily.LilyError, match="context overflow"):
        s.prefill(list(range(7)))
    assert s.position == 10
    s.prefill(list(range(6)))
    with pytest.raises(lily.LilyError, match="context overflow"):
        s.decode_step(1)


def test_sessions_are_independent(model, rng):
    a, b = model.new_session(), model.new_session()
    ids = rng.integers(0, 313, 30)
    ra = a.prefill(ids)
    b.prefill(rng.integers(0, 313, 30))
    np.testing.assert_array_equal(a.decode_step(3), model.new_session().prefill(np.append(ids, 3)))
    assert ra.shape == (313,)


def test_device_errors(ckpt):
    with pytest.raises(lily.DeviceError, match="not available"):
        lily.Model.load(ckpt, device="metal")
    with pytest.raises(lily.DeviceError, match="unknown device"):
        lily.Model.load(ckpt, device="tpu")
    if not lily._core.backend_available("cuda"):
        with pytest.raises(lily.DeviceError, match="cuda"):
            lily.Model.load(ckpt, device="cuda")
    assert lily.Model.load(ckpt, device="auto").device in ("cpu", "cuda")


def test_profile_times_every_group_and_changes_nothing(model, rng):
    """Session.profile runs the same computation (same sampled tokens) and names where time went."""
    cfg = model.config
    ids = rng.integers(0, cfg.vocab_size, 20).astype(np.int32)
    plain = model.new_session()
    plain._core.set_sampler()
    plain._core.prefill_sample(ids)
    for _ in range(3):
        plain._core.decode_sample(-1)
    prof = model.new_session()
    prof._core.set_sampler()
    out = prof._core.profile(ids, 3)
    assert prof.position == plain.position == 20 + 3
    # The next draw after the profiled steps equals the plain session's (same state, same sampler).
    assert prof._core.decode_sample(-1) == plain._core.decode_sample(-1)
    n_attn = sum(1 for t in cfg.layer_types if t == "full_attention")
    n_gdn = cfg.num_hidden_layers - n_attn
    dec = out["decode"]  # one span per op entry, "<layer label>.<op>"
    assert dec["embedding"][1] == dec["lm_head.linear_rms_normed"][1] == dec["sample"][1] == 3
    # one token: each residual add and the norm after it run inside the op before them (the last layer's
    # MoE has no norm after it)
    assert dec["moe"][1] == 3 and dec["moe_add_rms_norm"][1] == 3 * (cfg.num_hidden_layers - 1)
    assert "add_rms_norm" not in dec
    assert dec["gdn.gdn_decode_mixer"][1] == 3 * n_gdn and dec["attn.gated_attention"][1] == 3 * n_attn
    assert dec["gdn.linear"][1] == 3 * n_gdn and dec["attn.linear"][1] == 3 * n_attn  # the stacked input projection
    assert dec["gdn.linear_add_rms_norm"][1] == 3 * n_gdn and dec["attn.linear_add_rms_norm"][1] == 3 * n_attn
    pre = out["prefill"]
    assert pre["lm_head.linear_rms_normed"][1] == 1 and pre["moe"][1] == cfg.num_hidden_layers
    # a prompt's attention layers run gated_attention too (one op: its per-op sequence on the CPU, nested)
    assert pre["attn.gated_attention"][1] == n_attn and "attn.attention" not in pre
    assert all(ms >= 0 for ms, _ in dec.values()) and sum(ms for ms, _ in dec.values()) > 0


def test_close_releases_the_model_and_its_sessions(ckpt):
    m = lily.Model.load(ckpt, device="cpu", max_context=64, prefill_chunk=32)
    s = m.new_session()
    s.prefill([1, 2, 3])
    s.remember_prefix(s.snapshot())
    m.prefill([4, 5])
    m.close()
    assert m.closed and "closed" in repr(m) and repr(s) == "Session(closed)"
    assert s.prefix_snapshots == () and s.tokens == ()
    for call in (lambda: m.prefill([1]), lambda: m.decode_step(1), lambda: m.new_session(),
                 lambda: m.generate([1, 2], max_tokens=2), lambda: s.prefill([1]), lambda: s.decode_step(1),
                 lambda: s.snapshot(), lambda: s.position):
        with pytest.raises(lily.LilyError, match="closed"):
            call()
    m.close()  # idempotent


def test_close_waits_for_running_generations_and_with_closes(ckpt):
    with lily.Model.load(ckpt, device="cpu", max_context=64, prefill_chunk=32) as m:
        stream = m.generate([1, 2, 3], max_tokens=8, stream=True)
        next(iter(stream))
        with pytest.raises(lily.LilyError, match="still running"):
            m.close()
        assert not m.closed
        stream.close()
        assert len(m.generate([1, 2, 3], max_tokens=2).token_ids) == 2
    assert m.closed


def test_decode_runs_stacked_projections_bit_exactly():
    # Every layer's same-input projections (GDN in_proj qkv|z|b|a or attention q|k|v, and the MoE
    # router + shared-expert gate) share one storage format here, so a decode step runs each group
    # as one stacked GEMV; prefill runs them apart.
    from lily.checkpoint.tiny import tiny_checkpoint

    m = lily.Model.load(tiny_checkpoint(), device="cpu")
    assert m._engine.stacked_projections == 2 * m.config.num_hidden_layers  # mixer inputs, router + gate
    ids = [5, 17, 99, 1000, 42, 7, 31337]
    full = m.new_session().prefill(ids, all_logits=True)
    s = m.new_session()
    s.prefill(ids[:1])
    steps = np.stack([s.decode_step(t) for t in ids[1:]])
    np.testing.assert_array_equal(steps, full[1:])


def test_snapshot_restore_and_reset_release_the_gil():
    """A state copy (~1 ms on the H200) must not stall the server's event loop thread: another Python
    thread keeps running during snapshot/restore/reset. Failed before (the GIL was held)."""
    import statistics
    import threading
    import time

    from lily.checkpoint.tiny import tiny_checkpoint

    m = lily.Model.load(tiny_checkpoint(), device="cpu", max_context=8192)
    s = m.new_session(8192)
    s.prefill(np.arange(2000) % 1000 + 10)  # a state big enough that a copy takes a while
    snap = s.snapshot()
    stop, delays, calls = threading.Event(), [], []

    def ticker():  # how late a short sleep wakes: the GIL wait, when another thread holds it
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.0002)
            delays.append(time.perf_counter() - t - 0.0002)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        for _ in range(60):
            t = time.perf_counter()
            s._core.restore(snap._core)
            s._core.snapshot()
            s._core.reset()
            calls.append(time.perf_counter() - t)
    finally:
        stop.set()
        thread.join()
    assert len(delays) > 20 and statistics.median(delays) < statistics.median(calls) / 2, \
        (statistics.median(delays), statistics.median(calls))
