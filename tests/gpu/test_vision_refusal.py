"""Images are CPU-only for now (issue 17, first phase): on CUDA the vision tower and each of its ops
raise an error naming the missing piece, while text-only prompts run as before."""
from __future__ import annotations

import numpy as np
import pytest

import lily
from lily import _core
from lily.checkpoint import synthetic
from lily.errors import LilyError

pytestmark = pytest.mark.gpu
ops = _core.ops


def test_vision_ops_refuse_cuda():
    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    for call in (lambda: ops.layer_norm("cuda", x, w, w, 1e-6), lambda: ops.add_bias("cuda", x, w),
                 lambda: ops.gelu("cuda", x, True),
                 lambda: ops.vision_rope("cuda", np.ones((2, 24), np.float32), np.zeros((2, 2), np.int32), 2, 1e4),
                 lambda: ops.vision_attention("cuda", np.ones((2, 24), np.float32), np.array([0, 2], np.int32), 2),
                 lambda: ops.vision_position_embedding("cuda", np.ones((4, 8), np.float32), np.zeros((2, 2), np.int32),
                                                       2, 2, x)):
        with pytest.raises(LilyError, match="not implemented on CUDA yet; use device='cpu' for images"):
            call()


def test_encode_images_refuses_cuda_and_text_still_runs(tmp_path):
    path = synthetic.make_checkpoint(tmp_path, "tiny", layout="hf", with_tokenizer=False, vision=True)
    m = lily.Model.load(path, device="cuda")
    with pytest.raises(LilyError, match="not implemented on CUDA yet; use device='cpu' for images"):
        m._engine.encode_images(np.zeros((4, 1536), np.float32), np.array([[1, 2, 2]], np.int32))
    assert np.isfinite(m.prefill([1, 2, 3])).all()
