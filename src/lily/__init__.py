"""lily: a batch-1 inference engine for Qwen3.5/3.6 hybrid MoE checkpoints (Qwen3.6-35B-A3B).

    import lily
    model = lily.Model.load("path/or/org/repo")        # device="auto": CUDA when available
    print(model.generate("The capital of France is", max_tokens=16).text)
    for event in model.chat([{"role": "user", "content": "Hi!"}], stream=True, temperature=0.7):
        print(event.text, end="", flush=True)
    logits = model.prefill(token_ids)                  # step-wise: [vocab] float32 of the last token
    logits = model.decode_step(next_id)
"""
from .errors import CheckpointError, ConfigError, DeviceError, LilyError
from .generate import Generation, GenerationEvent, GenerationStream, TokenLogprob, Usage
from .model import Model, Session, Snapshot
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = ["CheckpointError", "ConfigError", "DeviceError", "Generation", "GenerationEvent", "GenerationStream",
           "LilyError", "Model", "SamplingParams", "Session", "Snapshot", "TokenLogprob", "Tokenizer", "Usage",
           "make_checkpoint"]
__version__ = "0.1.0"


def make_checkpoint(*args, **kwargs):
    """Write a random synthetic checkpoint; see lily.synthetic.make_checkpoint."""
    from .synthetic import make_checkpoint as make

    return make(*args, **kwargs)
