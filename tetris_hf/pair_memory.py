"""What the ``adaptive`` and ``dsd`` strategies learnt about one target/draft pair, kept between ``generate()``
calls on the same two model objects (in memory, forgotten with the models), and saved to a file and loaded in another
process on request (:func:`save_pair_memory`, :func:`load_pair_memory`). Calls with compiled steps
(``tetris_compile=True``) learn apart from eager ones: a step's costs, and so whether drafting paid, differ between the
two (a compiled verify block is padded, an eager one packed).
"""

from __future__ import annotations

import hashlib
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from .cost_model import AcceptanceCalibrator


class RealizedGain(NamedTuple):
    """What drafting plans emitted against what they predicted, over the steps the guard counted (each step's weight
    falling by ``decay`` a newer one): ``tokens`` emitted, and ``predicted`` the tokens their plans expected in the
    same time (the plain steps' tokens in that time times the plan's predicted speed-up over plain decoding)."""

    tokens: float = 0.0
    predicted: float = 0.0

    def add(self, tokens: float, predicted: float, decay: float) -> "RealizedGain":
        return RealizedGain(decay * self.tokens + tokens, decay * self.predicted + predicted)

    def factor(self, prior: float, low: float = 0.25, high: float = 2.0) -> float:
        """Realized over predicted, pulled towards 1 by ``prior`` tokens on each side (few steps say little), within
        ``[low, high]``: what a plan's predicted speed-up is worth."""
        return min(max((self.tokens + prior) / (self.predicted + prior), low), high)

    def faded(self, weight: float) -> "RealizedGain":
        """The same evidence at ``weight`` (what drafting realized long ago counts for less)."""
        return RealizedGain(weight * self.tokens, weight * self.predicted)


def _no_gain_yet() -> dict[bool, RealizedGain]:
    return {False: RealizedGain(), True: RealizedGain()}


@dataclass
class PairMemory:
    """What ``adaptive`` and ``dsd`` learnt about one target/draft pair, kept between ``generate()`` calls.

    ``calibrator``: acceptance by draft probability; ``pool``: ``(P, W)`` log q of recently drafted rows, newest
    first; ``pool_sources``: ``(P,)`` which source drafted each pooled row (hybrid drafting); ``dsd_acceptance``: DSD's
    running acceptance rate; ``plain_streak`` and ``probe_interval``: the probe schedule; ``guarded``: the
    realized-rate guard stopped drafting and no probe has drafted since, ``guarded_rows`` the batch's rows then (the
    verdict holds for batches of at least half as many); ``realized``: what drafting plans realized against their
    predictions, apart for plans drafting with the model (``False``) and by prompt lookup alone
    (``True``, hybrid drafting); ``plain_seconds``: a plain step's measured seconds by rows (the guard's price);
    ``probe_cost``: a probe's measured seconds, the draft's catch-up included, over a plain step's (smoothed).
    """

    calibrator: AcceptanceCalibrator = field(default_factory=AcceptanceCalibrator)
    pool: torch.Tensor | None = None
    pool_sources: torch.Tensor | None = None
    dsd_acceptance: float | None = None
    plain_streak: int = 0
    probe_interval: int = 8
    guarded: bool = False
    guarded_rows: int = 0  # the batch's rows when the guard stopped drafting (0: not known, as in older files)
    realized: dict[bool, RealizedGain] = field(default_factory=_no_gain_yet)
    plain_seconds: dict[int, float] = field(default_factory=dict)
    probe_cost: float | None = None


# draft -> target -> {hybrid: PairMemory}
_PAIR_MEMORY: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()


class _PromptLookup:
    """Stands for prompt lookup, which has no draft model, as a key of :data:`_PAIR_MEMORY`."""


_PROMPT_LOOKUP = _PromptLookup()


def pair_memory(model: torch.nn.Module, assistant_model: torch.nn.Module | None, hybrid: bool = False,
                compiled: bool = False) -> PairMemory:
    """The :class:`PairMemory` of these two model objects, for greedy calls (a sampled call starts afresh: its tokens
    must not depend on earlier calls). ``assistant_model=None``: prompt lookup on this target. ``hybrid``: the memory
    of calls whose draft drafts beside prompt lookup (calibrated confidences, learnt apart); ``compiled``: of calls
    with compiled steps (their costs, learnt apart)."""
    return _memories(model, assistant_model).setdefault((hybrid, compiled), PairMemory())


def _memories(model: torch.nn.Module, assistant_model: torch.nn.Module | None) -> dict:
    """This pair's memories in this process, by kind: ``{(hybrid, compiled): PairMemory}``."""
    draft_key = _PROMPT_LOOKUP if assistant_model is None else assistant_model
    return _PAIR_MEMORY.setdefault(draft_key, weakref.WeakKeyDictionary()).setdefault(model, {})


MEMORY_FORMAT, MEMORY_VERSION = "tetris-hf-pair-memory", 1


def pair_fingerprint(model: torch.nn.Module, assistant_model: torch.nn.Module | None) -> str:
    """What a pair's memory belongs to: both configurations and a sample of both models' weights (the first and last
    1,024 values of the first and last parameter tensors: two drafts of one architecture differ there), so that a
    memory is never loaded into another pair. ``assistant_model=None``: prompt lookup on ``model``."""
    parts = []
    for part in (model, assistant_model):
        if part is None:
            parts.append(b"prompt-lookup")
            continue
        config = getattr(part, "config", None)
        parts.append(config.to_json_string(use_diff=False).encode() if config is not None else type(part).__name__.encode())
        parameters = list(part.parameters())
        for tensor in (parameters[0], parameters[-1]):
            flat = tensor.detach().flatten()
            sample = torch.cat([flat[:1024], flat[-1024:]]).float().cpu()  # (a read, once per save or load)
            parts.append(sample.numpy().tobytes())
    return hashlib.sha1(b"|".join(parts)).hexdigest()[:20]


def save_pair_memory(model: torch.nn.Module, assistant_model: torch.nn.Module | None, path: str | os.PathLike,
                     hybrid: bool = False, compiled: bool = False) -> Path:
    """Save what ``adaptive`` and ``dsd`` learnt about this pair in this process to ``path`` (a small ``torch.save``
    file), so that a later process starts from it (:func:`load_pair_memory`). ``hybrid``: the memory of hybrid calls
    (a draft beside prompt lookup); ``compiled``: of calls with ``tetris_compile=True``. Returns the path."""
    memory = pair_memory(model, assistant_model, hybrid, compiled)
    calibrator = memory.calibrator
    state = {
        "format": MEMORY_FORMAT, "version": MEMORY_VERSION, "pair": pair_fingerprint(model, assistant_model),
        "hybrid": hybrid, "compiled": compiled,
        "calibrator": {"prior_accepted": calibrator.prior_accepted, "prior_rejected": calibrator.prior_rejected,
                       "accepted": calibrator.accepted, "rejected": calibrator.rejected,
                       "memory": calibrator.memory},
        "pool": memory.pool, "pool_sources": memory.pool_sources, "dsd_acceptance": memory.dsd_acceptance,
        "plain_streak": memory.plain_streak, "probe_interval": memory.probe_interval, "guarded": memory.guarded,
        "guarded_rows": memory.guarded_rows,
        "realized": {key: list(gain) for key, gain in memory.realized.items()},
        "plain_seconds": dict(memory.plain_seconds), "probe_cost": memory.probe_cost,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def load_pair_memory(model: torch.nn.Module, assistant_model: torch.nn.Module | None, path: str | os.PathLike,
                     hybrid: bool = False, compiled: bool = False) -> PairMemory:
    """Start this pair's memory in this process from a file :func:`save_pair_memory` wrote (replacing what this
    process learnt so far). Raises ``ValueError`` for a file that is not such a memory, or is another pair's (another
    target, draft or weights) or of another kind (hybrid or not, compiled steps or not)."""
    path = Path(path)
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:  # (unpickling errors have no common type)
        raise ValueError(f"{path} is not a tetris-hf pair memory: {type(error).__name__}: {error}") from None
    if not isinstance(state, dict) or state.get("format") != MEMORY_FORMAT or state.get("version") != MEMORY_VERSION:
        raise ValueError(f"{path} is not a tetris-hf pair memory (format {MEMORY_FORMAT!r}, version "
                         f"{MEMORY_VERSION})")
    if state["pair"] != pair_fingerprint(model, assistant_model):
        raise ValueError(f"{path} holds the memory of another pair (other models or weights): it would mislead "
                         "`adaptive` about these drafts")
    if state["hybrid"] != hybrid:
        raise ValueError(f"{path} holds the memory of {'hybrid' if state['hybrid'] else 'single-source'} calls: pass "
                         f"hybrid={state['hybrid']}")
    if state.get("compiled", False) != compiled:  # (files saved before this was kept: eager calls')
        raise ValueError(f"{path} holds the memory of calls with{'' if state.get('compiled') else 'out'} compiled "
                         f"steps, whose costs differ: pass compiled={bool(state.get('compiled'))}")
    saved = state["calibrator"]
    calibrator = AcceptanceCalibrator(num_bins=saved["accepted"].numel(), memory=saved["memory"])
    calibrator.prior_accepted, calibrator.prior_rejected = saved["prior_accepted"], saved["prior_rejected"]
    calibrator.accepted, calibrator.rejected = saved["accepted"], saved["rejected"]
    memory = PairMemory(calibrator, state["pool"], state["pool_sources"], state["dsd_acceptance"],
                        state["plain_streak"], state["probe_interval"], bool(state.get("guarded", False)))
    for key, gain in state.get("realized", {}).items():  # (files saved before these were kept: start afresh)
        memory.realized[bool(key)] = RealizedGain(*map(float, gain))
    memory.plain_seconds = {int(rows): float(seconds) for rows, seconds in state.get("plain_seconds", {}).items()}
    memory.probe_cost = state.get("probe_cost")
    memory.guarded_rows = int(state.get("guarded_rows", 0))
    _memories(model, assistant_model)[hybrid, compiled] = memory
    return memory
