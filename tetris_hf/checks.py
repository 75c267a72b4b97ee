"""The refusals of a ``generate()`` call's inputs, each made once, before any model runs a forward.

:func:`check_pair` and :func:`check_prompt_shape` run in :func:`~tetris_hf.generation.generate` before transformers'
preparation; :func:`check_generation_config`, :func:`check_prompt_mask` and :func:`check_streamer` in
:func:`~tetris_hf.decoding.tetris_decoding` on what it prepared. Options are checked by
:class:`~tetris_hf.options.TetrisOptions`; what a model cannot serve, where its layout is read
(:mod:`tetris_hf.families`, :mod:`tetris_hf.attention`, :mod:`tetris_hf.compiled`, ``build_drafter``,
:mod:`tetris_hf.candidate_generators.reduced_vocab`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache

from .families import check_supported


def output_vocab_size(model: torch.nn.Module) -> int:
    """The last dimension of the model's logits: the rows of its output head, else (no head, e.g. an EAGLE-3 head)
    its text config's ``vocab_size``."""
    head = model.get_output_embeddings()
    if head is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def check_pair(model: torch.nn.Module, assistant_model: torch.nn.Module | None, prompt_lookup: bool = False) -> None:
    """Refuse a missing draft (unless ``prompt_lookup``), one whose vocabulary differs from the target's, and models
    the loop cannot serve (:func:`~tetris_hf.families.check_supported`)."""
    if prompt_lookup and assistant_model is None:
        check_supported(model, "target")
        return
    if assistant_model is None:
        raise ValueError("custom_generate='tetris' needs a draft: pass `assistant_model=` (a small causal LM with the "
                         "target's tokenizer) or `prompt_lookup_num_tokens=` (drafts copied from each row's own prompt "
                         "and output)")
    if not hasattr(assistant_model, "get_output_embeddings"):
        raise TypeError(f"`assistant_model` must be a transformers causal LM, got {type(assistant_model).__name__}")
    check_same_vocabulary(model, assistant_model)
    check_supported(model, "target")
    check_supported(assistant_model, "draft")


def check_same_vocabulary(model: torch.nn.Module, assistant_model: torch.nn.Module) -> None:
    """Refuse a draft whose output head scores another vocabulary than the target's (a ``ValueError`` naming both
    sizes)."""
    target_vocab, draft_vocab = output_vocab_size(model), output_vocab_size(assistant_model)
    if target_vocab != draft_vocab:
        raise ValueError(f"draft and target vocabularies differ (target {target_vocab} tokens, draft {draft_vocab}): "
                         "tetris_hf needs a draft that shares the target's tokenizer")


def check_prompt_shape(input_ids) -> None:
    """A prompt of token ids must be ``(batch_size, length)`` with ``length >= 1`` (other inputs, such as
    ``inputs_embeds``, are ``generate()``'s to validate)."""
    if not isinstance(input_ids, torch.Tensor):
        return
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch_size, length), got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: every row needs at least one token")


def check_prompt_mask(attention_mask: torch.Tensor) -> None:
    """Every row must be left-padded (zeros only before its first real token) and hold at least one real token."""
    empty = (attention_mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row(s) {empty} of attention_mask are all padding: every row needs at least one token")
    not_left_padded = (attention_mask[:, 1:] < attention_mask[:, :-1]).any(dim=1).nonzero().flatten().tolist()
    if not_left_padded:
        raise ValueError(f"attention_mask row(s) {not_left_padded} have padding after a real token (right padding?): "
                         "tetris_hf needs a left-padded batch, e.g. tokenizer.padding_side = 'left'")


def check_generation_config(generation_config, model_kwargs: dict) -> None:
    """Refuse what this loop does not do, before anything runs."""
    if generation_config.num_beams != 1:
        raise ValueError(f"tetris_hf does not do beam search (num_beams={generation_config.num_beams}); use num_beams=1")
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise ValueError(f"`{flag}=True` is not supported by tetris_hf; `return_dict_in_generate=True` gives "
                             "`.sequences` and `.tetris_stats`")
    if generation_config.use_cache is False:
        raise ValueError("tetris_hf needs the KV cache: do not pass use_cache=False")
    cache = model_kwargs.get("past_key_values")
    implementation = generation_config.cache_implementation
    if isinstance(cache, StaticCache) or implementation not in (None, "dynamic"):
        raise ValueError(f"unsupported cache (cache_implementation={implementation!r}, past_key_values="
                         f"{type(cache).__name__}): tetris_hf rolls rows back independently and needs the default "
                         "dynamic cache")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("tetris_hf starts from the prompt: passing a pre-filled `past_key_values` is not supported")


def check_streamer(streamer, num_rows: int) -> None:
    """A streamer takes one row's tokens: refuse it with more rows (counted after ``num_return_sequences``)."""
    if streamer is not None and num_rows > 1:
        raise ValueError(f"a streamer needs batch size 1, got {num_rows} rows")
