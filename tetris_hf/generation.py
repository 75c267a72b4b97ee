"""The ``custom_generate`` entry point: ``model.generate(..., assistant_model=draft, custom_generate="tetris")``
runs :func:`generate`, which hands transformers' own ``generate()`` the loop as a callable ``custom_generate``.
Design: docs/design.md, "The entry point".
"""

from __future__ import annotations

import functools
import os

from transformers.generation.utils import GenerationMixin

from .checks import check_pair, check_prompt_shape
from .decoding import tetris_decoding
from .encoder_decoder import generate as generate_encoder_decoder
from .encoder_decoder import is_encoder_decoder
from .options import pop_options

STRATEGY_NAME = "tetris"


def generate(model, *args, **kwargs):
    """Batched speculative decoding with TETRIS selection; the function ``custom_generate="tetris"`` runs.

    Args:
        model: the target causal LM.
        *args, **kwargs: as for ``model.generate``; must include a draft: ``assistant_model`` (a small causal LM
            with the target's tokenizer, or an EAGLE head), ``prompt_lookup_num_tokens`` (with
            ``max_matching_ngram_size`` and ``tetris_min_ngram_size``) or ``tetris_suffix_num_tokens`` (with
            ``tetris_suffix_cache``, finished requests shared between calls, and ``tetris_suffix_min_prob``, where a
            draft stops), or a model and one of the others (hybrid drafting). tetris_hf's own options
            (:class:`~tetris_hf.options.TetrisOptions`):
            ``num_assistant_tokens`` (k, default 4), ``tetris_extra_tokens`` (e, default 2), ``tetris_budget`` (C,
            default k x active rows), ``tetris_strategy`` (``"tetris"``, ``"fixed"``, ``"adaptive"`` or ``"dsd"``),
            ``tetris_cost_profile``, ``tetris_step_callback``, ``tetris_max_holes``, ``tetris_draft_vocab``,
            ``tetris_compile`` (default ``None``: compiled once it pays, :mod:`~tetris_hf.compile_choice`),
            ``tetris_tree_width`` (draft trees), ``tetris_pack`` (packed verify steps) and
            ``tetris_confidence_threshold``.

    Returns:
        What ``generate()`` returns: ``(B, T)`` sequences, or with ``return_dict_in_generate=True`` a
        :class:`~tetris_hf.outputs.TetrisGenerateOutput` with ``.sequences`` and ``.tetris_stats``.
    """
    if is_encoder_decoder(model):  # Whisper: its decoders in the loop, see tetris_hf.encoder_decoder
        return generate_encoder_decoder(model, *args, **kwargs)
    assistant_model = kwargs.pop("assistant_model", None)
    streamer = kwargs.pop("streamer", None)  # the loop streams the prompt too, once it knows the batch is one row
    kwargs.pop("custom_generate", None)
    options = pop_options(kwargs)
    check_pair(model, assistant_model, prompt_lookup=options.model_free_tokens is not None)
    prompt = args[0] if args else kwargs.get("inputs")
    if prompt is None:  # generate(input_ids=...) reaches a custom_generate folder as inputs=None, input_ids=...
        prompt = kwargs.get("input_ids")
    check_prompt_shape(prompt)  # before transformers' preparation indexes it
    decoding = functools.partial(tetris_decoding, assistant_model=assistant_model, options=options, streamer=streamer)
    return GenerationMixin.generate(model, *args, custom_generate=decoding, **kwargs)


_original_load_custom_generate = GenerationMixin.load_custom_generate


def _load_custom_generate(self, pretrained_model_name_or_path=None, trust_remote_code=None, **kwargs):
    """``custom_generate="tetris"`` resolves to :func:`generate` unless ``./tetris`` holds a custom_generate folder."""
    local_folder = os.path.join(str(pretrained_model_name_or_path), "custom_generate", "generate.py")
    if pretrained_model_name_or_path == STRATEGY_NAME and not os.path.isfile(local_folder):
        return generate
    return _original_load_custom_generate(self, pretrained_model_name_or_path, trust_remote_code, **kwargs)


def register() -> None:
    """Make ``custom_generate="tetris"`` work on every transformers model (done by ``import tetris_hf``)."""
    GenerationMixin.load_custom_generate = _load_custom_generate
