"""Pipelined decoding on the GPU (docs/generation.md, "Pipelined decoding"): generate.py's loop, which
launches the next step's graph replay before it reads the sampled id (pinned copy + event) and takes a
speculative step back with decode_discard, against the same loop in the synchronous order (SyncCore,
tests/pipeline_cases.py); the ping-pong GDN state through both decode graphs; discards at either state
copy; a NaN sample with a step already launched on its id."""
from __future__ import annotations

import numpy as np
import pytest

import lily
from lily import LilyError, _core
from lily.checkpoint import synthetic
from checks import nan_norm_checkpoint
from pipeline_cases import PROMPT, assert_same_result, assert_same_session, both, pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]


@pytest.fixture(scope="module")
def model() -> lily.Model:
    return lily.load("tiny", "cuda", max_context=512)


@pytest.fixture(scope="module")
def real_widths(tmp_path_factory):
    """Real Qwen3.6 widths, 4 layers (3 GDN + 1 attention): the fused GDN decode kernel in 8-CTA clusters."""
    dims = {**synthetic.QWEN36_35B_A3B_TEXT_CONFIG, "num_experts": 16, "vocab_size": 4096}
    return synthetic.make_checkpoint(tmp_path_factory.mktemp("real"), dims, with_tokenizer=False, num_layers=4,
                                     direct_codes=True)


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=24),
    dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=7, logprobs=5),
    dict(max_tokens=24, choice=["alpha", "beta gamma", "delta"], seed=1),
    dict(max_tokens=24, regex=r"[0-9]{3}-[a-z]{2}", temperature=1.0, seed=5, logprobs=2),
])
def test_pipelined_equals_synchronous(model, kwargs):
    both(model, **kwargs)


def test_every_end_leaves_the_synchronous_state(model):
    greedy = model.generate(PROMPT, max_tokens=16, session=model.new_session())
    both(model, max_tokens=16, stop_token_ids=[greedy.token_ids[5]])
    text = greedy.text
    r, _, _ = both(model, max_tokens=16, stop=[text[len(text) // 2:][:2]])
    assert r.finish_reason == "stop"
    r, piped, _ = both(model, max_context=9, max_tokens=None)
    assert r.finish_reason == "length" and piped.position == 9
    for n in (1, 4):
        piped, sync = pair(model)
        for s in (piped, sync):
            stream = model.generate(PROMPT, max_tokens=16, stream=True, session=s)
            [next(stream) for _ in range(n)]
            stream.close()
        assert_same_session(piped, sync)


def test_multi_turn_reuse(model):
    piped, sync = pair(model)
    messages = [{"role": "user", "content": "Hi"}]
    for turn in range(3):
        r = model.chat(messages, max_tokens=8, temperature=0.8, seed=turn, session=piped)
        q = model.chat(messages, max_tokens=8, temperature=0.8, seed=turn, session=sync)
        assert_same_result(r, q)
        messages += [r.message, {"role": "user", "content": f"Again {turn}"}]
    assert_same_session(piped, sync)


@pytest.mark.parametrize("use_graph", [True, False])
def test_discard_at_either_state_copy(real_widths, use_graph):
    """Launch a step, take it back, launch it again: the same logits and state as never launching, at
    both copies of the GDN state (so through both captured decode graphs)."""
    m = lily.Model.load(real_widths, device="cuda")
    ids = np.random.default_rng(4).integers(0, m.config.vocab_size, 40).tolist()
    a, b = m.new_session(use_graph=use_graph), m.new_session(use_graph=use_graph)
    a.prefill(ids[:20])
    b.prefill(ids[:20])
    copies = set()
    for t in ids[20:]:
        copies.add(a._core.state_copy)
        a._core.decode_launch(t)
        a._core.decode_discard()
        np.testing.assert_array_equal(a.decode_step(t), b.decode_step(t))
        assert a._core.state_copy == b._core.state_copy
    assert copies == {0, 1}
    sa, sb = a.state(), b.state()
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
    assert (a._core.decode_graph_nodes > 0) == use_graph


def test_pipelined_primitives_equal_decode_sample(real_widths):
    """sample_launch, decode_launch(-1) before the id is on the host, sampled(): the ids and logprobs of
    decode_sample, the logprobs read from the pinned copy."""
    m = lily.Model.load(real_widths, device="cuda")
    ids = np.random.default_rng(5).integers(0, m.config.vocab_size, 30).astype(np.int32)
    kw = dict(temperature=0.8, top_k=40, seed=3, num_logprobs=5, prompt_ids=ids)
    a, b = m.new_session()._core, m.new_session()._core
    a.set_sampler(**kw)
    b.set_sampler(**kw)
    toks_a, toks_b = [a.prefill_sample(ids)], [b.prefill_sample(ids)]
    a.decode_launch(-1)
    for _ in range(40):
        a.sample_launch()
        a.decode_launch(-1)
        toks_a.append(a.sampled())
        toks_b.append(b.decode_sample(-1))
        for x, y in zip(a.last_logprobs(), b.last_logprobs()):
            np.testing.assert_array_equal(x, y)
    a.decode_discard()
    assert toks_a == toks_b and a.position == b.position and not a.launched


def test_nan_sample_takes_back_the_step_launched_on_it(tmp_path):
    """On the GPU the step after a NaN sample is launched on the clamped id -1 before the host knows;
    sampled() takes it back and raises."""
    ckpt = nan_norm_checkpoint(tmp_path / "nan")
    m = lily.Model.load(ckpt, device="cuda", max_context=64, check_weights=False)
    core = m.new_session()._core
    core.set_sampler()
    core.prefill(np.array([1, 2, 3], np.int32))
    core.decode_launch(5)
    copy = core.state_copy
    core.sample_launch()
    core.decode_launch(-1)
    with pytest.raises(LilyError, match="logits contain NaN"):
        core.sampled()
    assert core.position == 4 and not core.launched and core.state_copy == copy
