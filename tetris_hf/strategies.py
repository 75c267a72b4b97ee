"""How many tokens to draft and which of them to verify, each step.

A strategy answers three questions for the loop: ``num_draft_tokens(num_rows)`` (K this step), ``budget(num_rows)``
(draft tokens the target may verify across the batch) and ``select(token_log_probs, max_lengths, budget)`` (a verified
length per row). ``observe`` lets a strategy learn from what was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .selection import cumulative_log_probs, select_fixed, select_tetris

STRATEGIES = ("tetris", "fixed")


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class TetrisOptions:
    """The ``generate()`` keyword arguments of tetris_hf, validated.

    Args:
        num_assistant_tokens: ``k``, the base draft window per row (``>= 1``).
        tetris_extra_tokens: ``e``, extra proposals per row: TETRIS drafts ``K = k + e`` (``>= 0``).
        tetris_budget: ``C``, draft tokens verified per step across the batch (``>= 0``); ``None`` = ``k`` x active
            rows.
        tetris_strategy: ``"tetris"`` (select the top-``C`` cells) or ``"fixed"`` (every row verifies its first ``k``).
        tetris_max_holes: cache slots a row may waste to rejected drafts before the cache is repacked.
    """

    num_assistant_tokens: int = 4
    tetris_extra_tokens: int = 2
    tetris_budget: int | None = None
    tetris_strategy: str = "tetris"
    tetris_max_holes: int = 32

    def __post_init__(self):
        _check_count("num_assistant_tokens", self.num_assistant_tokens, 1)
        _check_count("tetris_extra_tokens", self.tetris_extra_tokens, 0)
        if self.tetris_budget is not None:
            _check_count("tetris_budget", self.tetris_budget, 0)
        _check_count("tetris_max_holes", self.tetris_max_holes, 0)
        if self.tetris_strategy not in STRATEGIES:
            raise ValueError(f"`tetris_strategy` must be one of {STRATEGIES}, got {self.tetris_strategy!r}")


class FixedWindow:
    """Standard batched speculative decoding: every active row drafts and verifies ``k`` tokens."""

    def __init__(self, options: TetrisOptions):
        self.k = options.num_assistant_tokens

    def num_draft_tokens(self, num_rows: int) -> int:
        return self.k

    def budget(self, num_rows: int) -> int:
        return self.k * num_rows

    def select(self, token_log_probs: torch.Tensor, max_lengths: torch.Tensor, budget: int) -> torch.Tensor:
        return select_fixed(max_lengths, self.k)

    def observe(self, token_log_probs: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor):
        pass


class TetrisSelection(FixedWindow):
    """TETRIS: every row drafts ``k + e``; the ``C`` cells with the highest cumulative draft probability are verified."""

    def __init__(self, options: TetrisOptions):
        super().__init__(options)
        self.extra = options.tetris_extra_tokens
        self.fixed_budget = options.tetris_budget

    def num_draft_tokens(self, num_rows: int) -> int:
        return self.k + self.extra

    def budget(self, num_rows: int) -> int:
        return self.k * num_rows if self.fixed_budget is None else self.fixed_budget

    def select(self, token_log_probs: torch.Tensor, max_lengths: torch.Tensor, budget: int) -> torch.Tensor:
        return select_tetris(cumulative_log_probs(token_log_probs), max_lengths, budget)


def make_strategy(options: TetrisOptions) -> FixedWindow:
    return TetrisSelection(options) if options.tetris_strategy == "tetris" else FixedWindow(options)
