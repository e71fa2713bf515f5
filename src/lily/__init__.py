"""lily: a batch-1 inference engine for Qwen3.5/3.6 hybrid MoE checkpoints (Qwen3.6-35B-A3B).

    import lily
    model = lily.load("path/or/org/repo")              # or "tiny": the built-in model; device="auto"
    print(model.generate("The capital of France is", max_tokens=16).text)
    for event in model.chat([{"role": "user", "content": "Hi!"}], stream=True, temperature=0.7):
        print(event.text, end="", flush=True)
    logits = model.prefill(token_ids)                  # step-wise: [vocab] float32 of the last token
    logits = model.decode_step(next_id)
"""
from . import constraints  # noqa: F401 (lily.constraints: json_schema, regex, grammar, choice, tool_call)
from ._version import __version__  # noqa: F401 (lily.__version__)
from .constraints import Constraint
from .errors import CheckpointError, ConfigError, DeviceError, LilyError
from .generate import Generation, GenerationEvent, GenerationStream, TokenLogprob, Usage
from .model import Model, Session, Snapshot
from .sampling import SamplingParams
from .snapshot_file import SnapshotFileError
from .tokenizer import Tokenizer

__all__ = ["CheckpointError", "ConfigError", "Constraint", "DeviceError", "Generation", "GenerationEvent", "GenerationStream",
           "LilyError", "Model", "SamplingParams", "Session", "Snapshot", "SnapshotFileError", "TokenLogprob",
           "Tokenizer", "Usage",
           "load", "make_checkpoint"]


def load(path_or_repo="tiny", device: str = "auto", **kwargs) -> Model:
    """``lily.Model.load(path_or_repo, device, **kwargs)``: a checkpoint folder, a Hugging Face repo id,
    or "tiny" for the built-in synthetic checkpoint (random weights, real tokenizer)."""
    return Model.load(path_or_repo, device, **kwargs)


def make_checkpoint(*args, **kwargs):
    """Write a random synthetic checkpoint; see lily.checkpoint.synthetic.make_checkpoint."""
    from .checkpoint.synthetic import make_checkpoint as make

    return make(*args, **kwargs)
