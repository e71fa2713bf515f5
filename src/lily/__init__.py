"""lily: a batch-1 inference engine for Qwen3.5/3.6 hybrid MoE checkpoints (Qwen3.6-35B-A3B).

    import lily
    model = lily.Model.load("path/or/org/repo")        # device="auto": CUDA when available
    logits = model.prefill(token_ids)                  # [vocab] float32 of the last token
    logits = model.decode_step(next_id)
"""
from .errors import CheckpointError, ConfigError, DeviceError, LilyError
from .model import Generation, Model, Session, Snapshot

__all__ = ["CheckpointError", "ConfigError", "DeviceError", "Generation", "LilyError", "Model", "Session",
           "Snapshot", "make_checkpoint"]
__version__ = "0.1.0"


def make_checkpoint(*args, **kwargs):
    """Write a random synthetic checkpoint; see lily.synthetic.make_checkpoint."""
    from .synthetic import make_checkpoint as make

    return make(*args, **kwargs)
