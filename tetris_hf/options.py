"""tetris_hf's ``generate()`` options: :class:`TetrisOptions`, each value checked when it is built, before any model
runs; :func:`pop_options` takes them out of a call's keyword arguments.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from transformers import GenerationConfig

from .cost_model import CostProfile
from .suffix_cache import SuffixCache

STRATEGIES = ("tetris", "fixed", "adaptive", "dsd")
DEFAULT_MAX_NGRAM_SIZE = 3  # ``max_matching_ngram_size`` when not given


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")


def check_lookup_sizes(num_tokens, max_ngram_size, min_ngram_size) -> None:
    """Refuse impossible lookup settings (before anything runs), naming the argument."""
    for name, value in (("prompt_lookup_num_tokens", num_tokens), ("max_matching_ngram_size", max_ngram_size),
                        ("tetris_min_ngram_size", min_ngram_size)):
        _check_count(name, value, 1)
    if min_ngram_size > max_ngram_size:
        raise ValueError(f"`tetris_min_ngram_size` ({min_ngram_size}) is above `max_matching_ngram_size` "
                         f"({max_ngram_size}): lookup would try no n-gram size")


def check_draft_vocab_spec(spec) -> None:
    """Validate ``tetris_draft_vocab`` on its own (before the draft's vocabulary size is known).

    Accepts ``None``, an int ``N >= 1``, or a non-empty 1-D integer tensor of distinct non-negative token ids.
    """
    if spec is None:
        return
    if isinstance(spec, torch.Tensor):
        if spec.dim() != 1 or spec.dtype.is_floating_point or spec.dtype.is_complex or spec.dtype == torch.bool:
            raise TypeError(f"`tetris_draft_vocab` as a tensor must be 1-D token ids (an integer dtype), got shape "
                            f"{tuple(spec.shape)} and dtype {spec.dtype}")
        if spec.numel() == 0:
            raise ValueError("`tetris_draft_vocab` is an empty tensor: the draft needs at least one token to propose")
        if int(spec.min()) < 0:
            raise ValueError(f"`tetris_draft_vocab` holds a negative token id ({int(spec.min())})")
        repeats = spec.numel() - torch.unique(spec).numel()
        if repeats:
            raise ValueError(f"`tetris_draft_vocab` holds duplicate token ids ({repeats} repeats): give each token "
                             "once")
        return
    if isinstance(spec, bool) or not isinstance(spec, int):
        raise TypeError(f"`tetris_draft_vocab` must be an int N (the N most frequent tokens) or a 1-D tensor of token "
                        f"ids, got {type(spec).__name__}")
    if spec < 1:
        raise ValueError(f"`tetris_draft_vocab` must be >= 1 tokens, got {spec}")


@dataclass(frozen=True)
class TetrisOptions:
    """The ``generate()`` keyword arguments of tetris_hf, validated; the README's options table says more of each.

    Args:
        num_assistant_tokens: ``k``, the base draft window per row (``>= 1``).
        tetris_extra_tokens: ``e``, extra proposals per row: each row drafts ``K = k + e`` (``>= 0``).
        tetris_budget: ``C``, drafts verified per step across the batch (``>= 0``); ``None``: ``k`` x active rows.
        tetris_strategy: ``"tetris"``, ``"fixed"``, ``"adaptive"`` or ``"dsd"`` (docs/design.md, "Selection").
        tetris_max_holes: cache slots a row may waste to rejected drafts before the cache is repacked.
        tetris_step_callback: ``fn(record, loop)`` after every step: the :class:`~tetris_hf.step.StepRecord` and the
            loop (``loop.batch``, ``loop.stats``, ``loop.strategy``, ``loop.drafter``; in ``generate()`` also
            ``loop.partial_outputs()``).
        tetris_cost_profile: for ``adaptive`` and ``dsd``, what :func:`~tetris_hf.cost_model.load_profile` takes;
            ``None``: measured at first use and cached.
        tetris_draft_vocab: the tokens a draft model's head scores: an int ``N`` (the most frequent) or a 1-D tensor.
        tetris_compile: run the target's verify forward and the draft's step through ``torch.compile``; ``None``
            (the default): eager, the target's forwards compiled once the call's eager steps have taken long enough
            for the compile to pay back, where a measurement on this machine (made once, cached) says compiled steps
            are faster (:mod:`tetris_hf.compile_choice`).
        tetris_tree_width: ``w``, children per expanded draft node; ``w > 1`` drafts a tree per row.
        tetris_pack: read each verify block packed where the target can be (:mod:`tetris_hf.packing`).
        prompt_lookup_num_tokens: draft by prompt lookup, up to this many tokens per row (it is ``k``).
        tetris_suffix_num_tokens: draft from a suffix cache, up to this many tokens per row (it is ``k``).
        tetris_suffix_cache: a :class:`~tetris_hf.suffix_cache.SuffixCache` shared between calls.
        tetris_suffix_min_prob: suffix drafts stop where a cell's calibrated survival (the estimated chance that it and
            every cell before it are accepted) falls below this; 0 drafts every cell found.
        max_matching_ngram_size: the longest n-gram prompt lookup matches (default 3).
        tetris_min_ngram_size: the shortest n-gram prompt lookup matches (default 1).
        tetris_confidence_threshold: a model's chain stops once every row's last draft has ``max q`` below this.
    """

    num_assistant_tokens: int = 4
    tetris_extra_tokens: int = 2
    tetris_budget: int | None = None
    tetris_strategy: str = "tetris"
    tetris_max_holes: int = 32
    tetris_step_callback: Callable | None = None
    tetris_cost_profile: str | os.PathLike | Mapping | CostProfile | None = None
    tetris_draft_vocab: int | torch.Tensor | None = None
    tetris_compile: bool | None = None
    tetris_tree_width: int = 1
    tetris_pack: bool = True
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    tetris_min_ngram_size: int = 1
    tetris_confidence_threshold: float | None = None
    tetris_suffix_num_tokens: int | None = None
    tetris_suffix_cache: SuffixCache | None = None
    tetris_suffix_min_prob: float = 0.1

    def __post_init__(self):
        self._check_lookup()
        self._check_suffix()
        check_draft_vocab_spec(self.tetris_draft_vocab)
        if not isinstance(self.tetris_pack, bool):
            raise TypeError(f"`tetris_pack` must be True or False, got {self.tetris_pack!r}")
        if self.tetris_compile is not None and not isinstance(self.tetris_compile, bool):
            raise TypeError(f"`tetris_compile` must be True, False or None (measured), got {self.tetris_compile!r}")
        _check_count("num_assistant_tokens", self.num_assistant_tokens, 1)
        _check_count("tetris_extra_tokens", self.tetris_extra_tokens, 0)
        if self.tetris_budget is not None:
            _check_count("tetris_budget", self.tetris_budget, 0)
        _check_count("tetris_max_holes", self.tetris_max_holes, 0)
        self._check_tree()
        self._check_threshold()
        if self.tetris_step_callback is not None and not callable(self.tetris_step_callback):
            raise TypeError(f"`tetris_step_callback` must be callable, got {type(self.tetris_step_callback).__name__}")
        if self.tetris_strategy not in STRATEGIES:
            raise ValueError(f"`tetris_strategy` must be one of {STRATEGIES}, got {self.tetris_strategy!r}")
        profile = self.tetris_cost_profile
        if profile is not None:
            if not isinstance(profile, (str, os.PathLike, Mapping, CostProfile)):
                raise TypeError(f"`tetris_cost_profile` must be a JSON path, a dict or a CostProfile, got "
                                f"{type(profile).__name__}")
            if isinstance(profile, (str, os.PathLike)):
                path = os.fspath(profile)
                if not Path(path).is_file() and not Path(path.split(":")[0]).is_file():
                    raise ValueError(f"`tetris_cost_profile` file {path!r} does not exist")

    def _check_threshold(self) -> None:
        threshold = self.tetris_confidence_threshold
        if threshold is None:
            return
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
            raise ValueError(f"`tetris_confidence_threshold` must be a number in (0, 1) (or None), got {threshold!r}")
        if self.model_free_tokens is not None:
            raise ValueError("`tetris_confidence_threshold` stops a draft model's chain on its confidence: prompt "
                             "lookup's drafts have none to stop on; leave out one of the two")
        if self.tetris_tree_width > 1:
            raise ValueError("`tetris_confidence_threshold` stops chains: a draft tree grows all its depths; use "
                             "tetris_tree_width=1")

    def _check_tree(self) -> None:
        width = self.tetris_tree_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"`tetris_tree_width` must be an int >= 1 (1: draft chains), got {width!r}")
        if width == 1:
            return
        if self.prompt_lookup_num_tokens is not None:
            raise ValueError("`tetris_tree_width` > 1 grows trees with a draft model or from suffix drafts "
                             "(`tetris_suffix_num_tokens`): prompt lookup drafts one continuation per row; use "
                             "tetris_tree_width=1")

    @property
    def model_free_tokens(self) -> int | None:
        """``k`` of the draft that needs no model (prompt lookup or the suffix cache), ``None`` without one."""
        if self.prompt_lookup_num_tokens is not None:
            return self.prompt_lookup_num_tokens
        return self.tetris_suffix_num_tokens

    def _check_suffix(self) -> None:
        suffix = self.tetris_suffix_num_tokens
        min_prob = self.tetris_suffix_min_prob
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0 <= min_prob < 1:
            raise ValueError(f"`tetris_suffix_min_prob` must be a number in [0, 1), got {min_prob!r}")
        if suffix is None:
            for name in ("tetris_suffix_cache", "tetris_suffix_min_prob"):
                if getattr(self, name) != getattr(TetrisOptions, name):
                    raise ValueError(f"`{name}` applies to suffix drafts: pass `tetris_suffix_num_tokens=` too")
            return
        _check_count("tetris_suffix_num_tokens", suffix, 1)
        if self.prompt_lookup_num_tokens is not None:
            raise ValueError("`tetris_suffix_num_tokens` and `prompt_lookup_num_tokens` are two model-free drafts for "
                             "the same place (suffix drafts search the row's own tokens too): pass one of them")
        self._check_model_free_window("tetris_suffix_num_tokens", suffix, "suffix drafts (alone or hybrid)")
        if self.tetris_suffix_cache is not None and not isinstance(self.tetris_suffix_cache, SuffixCache):
            raise TypeError(f"`tetris_suffix_cache` must be a tetris_hf.suffix_cache.SuffixCache, got "
                            f"{type(self.tetris_suffix_cache).__name__}")

    def _check_lookup(self) -> None:
        lookup = self.prompt_lookup_num_tokens
        if lookup is None:
            if self.max_matching_ngram_size is not None or self.tetris_min_ngram_size != 1:
                raise ValueError("`max_matching_ngram_size` and `tetris_min_ngram_size` apply to prompt lookup: pass "
                                 "`prompt_lookup_num_tokens=` too")
            return
        max_ngram = DEFAULT_MAX_NGRAM_SIZE if self.max_matching_ngram_size is None else self.max_matching_ngram_size
        check_lookup_sizes(lookup, max_ngram, self.tetris_min_ngram_size)
        self._check_model_free_window("prompt_lookup_num_tokens", lookup,
                                      "prompt lookup (alone, which has no head, or hybrid)")

    def _check_model_free_window(self, name: str, window: int, drafts: str) -> None:
        """A model-free draft's window ``name`` is ``k``; no draft head to shape with ``tetris_draft_vocab``."""
        if self.num_assistant_tokens != window:
            raise ValueError(f"`{name}` ({window}) is the window k: drop `num_assistant_tokens` "
                             f"({self.num_assistant_tokens}) or make them equal")
        if self.tetris_draft_vocab is not None:
            raise ValueError(f"`tetris_draft_vocab` shapes a draft model's head and is not supported with {drafts}: "
                             "drop it")


OPTION_NAMES = tuple(option.name for option in dataclasses.fields(TetrisOptions))
# generate()'s own arguments that tetris_hf serves itself, read from a generation config as well
CONFIG_OPTIONS = ("num_assistant_tokens", "prompt_lookup_num_tokens", "max_matching_ngram_size")


def pop_options(kwargs: dict) -> TetrisOptions:
    """Take tetris_hf's keyword arguments out of ``kwargs``; those ``generate()`` also knows
    (:data:`CONFIG_OPTIONS`) also out of a generation config, which is replaced by a copy without them (else
    ``generate()`` would pick a mode of its own for them, and refuse a batch)."""
    values = {name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs}
    config = kwargs.get("generation_config")
    defaults = GenerationConfig()
    if config is not None:
        config = copy.deepcopy(config)
        for name in CONFIG_OPTIONS:
            value = getattr(config, name, None)
            if name not in values and value is not None and value != getattr(defaults, name):
                values[name] = value
            setattr(config, name, getattr(defaults, name))
        kwargs["generation_config"] = config
    if values.get("prompt_lookup_num_tokens") is not None:
        values.setdefault("num_assistant_tokens", values["prompt_lookup_num_tokens"])  # lookup's k is the window
    elif values.get("tetris_suffix_num_tokens") is not None:
        values.setdefault("num_assistant_tokens", values["tetris_suffix_num_tokens"])  # (so is the suffix draft's)
    return TetrisOptions(**values)
