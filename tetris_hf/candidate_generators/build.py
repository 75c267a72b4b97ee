"""Which drafter a call gets (:func:`build_drafter`), and the refusals of what the chosen one cannot do."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import AttentionLayout, check_tree_layout
from ..logits import PositionwiseLogitsProcessor
from ..options import DEFAULT_MAX_NGRAM_SIZE, TetrisOptions
from ..packed_probe import packs_exactly
from .batched_draft import BatchedDraftCandidateGenerator
from .drafter import Drafter
from .eagle import is_eagle_head
from .eagle_drafter import EagleCandidateGenerator
from .hybrid import HybridCandidateGenerator
from .prompt_lookup import BatchedPromptLookupCandidateGenerator
from .reduced_vocab import reduced_vocab_draft
from .suffix import SuffixCandidateGenerator


def build_drafter(assistant_model: torch.nn.Module | None, options: TetrisOptions,
                  logits_processor: PositionwiseLogitsProcessor, do_sample: bool, max_rows: int,
                  cache_capacity: Callable[[torch.nn.Module], int]) -> tuple[Drafter, torch.nn.Module | None]:
    """The drafter ``assistant_model`` and ``options`` ask for, and the model it drafts with: prompt lookup (no
    model), suffix drafts (``tetris_suffix_num_tokens``), an EAGLE head, a draft model (its head reduced by
    ``tetris_draft_vocab``), or lookup or suffix drafts beside either (the hybrid). Everything is refused before any
    forward; a draft packs (``tetris_pack``) where :func:`~tetris_hf.packed_probe.packs_exactly` holds.

    ``logits_processor``, ``do_sample``: the loop's; ``max_rows``: the most rows a draft model's cache will hold
    (0: the prompts'); ``cache_capacity``: the slots a model's cache needs. Returns ``(drafter, draft_model)``, the
    model that drafts (the reduced-vocabulary draft where there is one; ``None`` with no model).
    """
    max_draft = options.num_assistant_tokens + options.tetris_extra_tokens
    lookup = _model_free(options, max_draft, assistant_model is None)
    if assistant_model is None:
        return lookup, None
    if options.tetris_tree_width > 1 and options.tetris_suffix_num_tokens is not None:
        raise ValueError("`tetris_tree_width` > 1 with `tetris_suffix_num_tokens` beside an `assistant_model` (hybrid "
                         "drafting) is not supported: the hybrid merges chains only (a row's tree would have to come "
                         "from one source, verified by that source's rule, the model's cache rolled back along a "
                         "suffix path it did not draft); draft suffix trees alone (no assistant_model) or hybrid "
                         "chains (tetris_tree_width=1)")
    draft_model = reduced_vocab_draft(assistant_model, options.tetris_draft_vocab)
    if options.tetris_tree_width > 1:  # a tree's nodes read ancestor masks
        check_tree_layout(AttentionLayout.of(draft_model), draft_model)
    eagle = is_eagle_head(draft_model)
    drafter_class = EagleCandidateGenerator if eagle else BatchedDraftCandidateGenerator
    # (a draft model compiles its one-token step on static shapes, which a tree's growth, reading ancestor masks, does
    # not take: a tree's drafter runs eager)
    compile = bool(options.tetris_compile) and options.tetris_tree_width == 1
    drafter = drafter_class(draft_model, logits_processor, do_sample, max_holes=options.tetris_max_holes,
                            capacity=cache_capacity(draft_model), compile=compile, max_rows=max_rows)
    drafter.pack = options.tetris_pack and packs_exactly(draft_model)  # (reads with filler; compiled steps never pack)
    drafter.stop_below = options.tetris_confidence_threshold
    if lookup is not None:
        return HybridCandidateGenerator(lookup, drafter), draft_model
    return drafter, draft_model


def _model_free(options: TetrisOptions, max_draft: int, alone: bool) -> Drafter | None:
    """The model-free drafter the options ask for (or, ``alone``, with no model: prompt lookup), else ``None``."""
    if options.tetris_suffix_num_tokens is not None:  # the batch's rows and earlier requests draft
        return SuffixCandidateGenerator(max_tokens=max(max_draft, 1), cache=options.tetris_suffix_cache,
                                        min_prob=options.tetris_suffix_min_prob)
    if options.prompt_lookup_num_tokens is not None or alone:  # the rows' own tokens draft
        max_ngram = options.max_matching_ngram_size
        return BatchedPromptLookupCandidateGenerator(
            DEFAULT_MAX_NGRAM_SIZE if max_ngram is None else max_ngram, options.tetris_min_ngram_size,
            max_tokens=max(max_draft, 1))
    return None
