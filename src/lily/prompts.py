"""Prompt preparation for Model.generate / chat: what a prompt is (text, token ids, chat messages, or
a list of those), chat messages rendered with the checkpoint's template, and the sampling arguments."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .errors import LilyError
from .sampling import SamplingParams
from .session import token_array

if TYPE_CHECKING:
    from .model import Model


def prepare(model: "Model", prompt, template: dict, images=None) -> tuple[list[int], int | None, bool, list]:
    """A prompt (text, chat messages or token ids) as (prompt ids, message boundary or None, whether
    the prompt leaves a think block open, its images as lily.images.PreparedImage); ``template``: the
    chat template's keyword arguments. Chat messages carry their images as content parts; text and
    token ids take ``images``, one per run of ``<|image_pad|>`` (a single pad is grown to the image's
    tokens). Either way each image's pad is expanded to its ``num_tokens``."""
    from .multimodal import expand_image_pads, extract_images, has_image_parts

    if is_messages(prompt):
        if images is not None:
            raise LilyError("images of chat messages go in their content: {'type': 'image', 'image': ...} parts")
        tok = model.tokenizer
        if has_image_parts(prompt):
            model.check_images()
        prompt, sources = extract_images(prompt)
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, **template)
        ids = tok.encode(text)
        history = tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=False, **template))
        boundary = len(history) if ids[:len(history)] == history else None
        thinking = opens_think(text)
    elif isinstance(prompt, str):
        ids, boundary, thinking, sources = model.tokenizer.encode(prompt), None, opens_think(prompt), [] if images is None else images
    elif isinstance(prompt, np.ndarray) or (isinstance(prompt, Sequence) and not isinstance(prompt, bytes)):
        ids = token_array(prompt, model.config.vocab_size).tolist()
        boundary, thinking, sources = None, False, [] if images is None else images
    else:
        raise LilyError(f"prompt must be text, token ids, chat messages or a list of those, "
                        f"got {type(prompt).__name__}")
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
        raise LilyError(f"images must be a list (one per image in the prompt), got {type(sources).__name__}")
    if not len(sources):
        return ids, boundary, thinking, []
    model.check_images()
    prepared = model.prepare_images(sources)
    ids, cuts = expand_image_pads(ids, prepared, model.config.image_token_id, [] if boundary is None else [boundary])
    return ids, (cuts[0] if cuts else None), thinking, prepared


def sampling_params(params: SamplingParams | None, overrides: dict) -> SamplingParams:
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise LilyError(f"params must be a lily.SamplingParams, got {type(params).__name__}")
    if overrides:
        names = [f.name for f in dataclasses.fields(SamplingParams)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise LilyError(f"unknown generation argument(s) {', '.join(unknown)}; sampling parameters are "
                            f"{', '.join(names)}")
        params = dataclasses.replace(params, **overrides)
    return params


def is_messages(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, Mapping) for m in prompt)


def is_batch(prompt) -> bool:
    """A list of prompts (texts, id lists or conversations), as opposed to one id list or conversation."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, np.ndarray)) or (isinstance(p, Sequence) and not isinstance(p, bytes))
                    for p in prompt))


def opens_think(text: str) -> bool:
    """Whether the prompt ends inside a think block (Qwen3.6's generation prompt with thinking on)."""
    return text.rfind("<think>") > text.rfind("</think>")
