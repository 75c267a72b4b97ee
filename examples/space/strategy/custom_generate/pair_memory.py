# Exported from tetris_hf/pair_memory.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""What the ``adaptive`` and ``dsd`` strategies learnt about one target/draft pair, kept between ``generate()``
calls on the same two model objects (in memory, forgotten with the models).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .cost_model import AcceptanceCalibrator


@dataclass
class PairMemory:
    """What ``adaptive`` and ``dsd`` learnt about one target/draft pair, kept between ``generate()`` calls.

    ``calibrator``: acceptance by draft probability; ``pool``: ``(P, W)`` log q of recently drafted rows, newest
    first; ``dsd_acceptance``: DSD's running acceptance rate; ``plain_streak`` and ``probe_interval``: the probe
    schedule (so that a pair known not to pay is probed ever more rarely, call after call).
    """

    calibrator: AcceptanceCalibrator = field(default_factory=AcceptanceCalibrator)
    pool: torch.Tensor | None = None
    pool_sources: torch.Tensor | None = None  # (P,) hybrid drafting: which source drafted each pooled row
    dsd_acceptance: float | None = None
    plain_streak: int = 0
    probe_interval: int = 8


# draft -> target -> {hybrid: PairMemory}
_PAIR_MEMORY: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()


class _PromptLookup:
    """Stands for prompt lookup, which has no draft model, as a key of :data:`_PAIR_MEMORY`."""


_PROMPT_LOOKUP = _PromptLookup()


def pair_memory(model: torch.nn.Module, assistant_model: torch.nn.Module | None, hybrid: bool = False) -> PairMemory:
    """The :class:`PairMemory` of these two model objects (in memory, forgotten with the models), for greedy calls: a
    sampled call starts afresh (its tokens must not depend on earlier calls, see
    :func:`~tetris_hf.strategies.make_strategy`). ``assistant_model=None``: prompt lookup on this target. ``hybrid``:
    the draft drafts beside prompt lookup, its confidences calibrated (:mod:`~tetris_hf.candidate_generators.hybrid`):
    another scale than its raw ``max q``, learnt apart."""
    draft_key = _PROMPT_LOOKUP if assistant_model is None else assistant_model
    by_target = _PAIR_MEMORY.setdefault(draft_key, weakref.WeakKeyDictionary())
    return by_target.setdefault(model, {}).setdefault(hybrid, PairMemory())
