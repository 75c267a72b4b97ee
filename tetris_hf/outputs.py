"""What a TETRIS ``generate()`` call returns: the usual output plus ``tetris_stats``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class TetrisStats:
    """Counts of one batched speculative ``generate()`` call (docs/design.md, "What ``return_dict_in_generate=True``
    returns"). Per-step lists have ``steps`` entries; per-row ones hold ``-1`` for rows already finished. ``lookup_*``
    count the cells of rows prompt lookup drafted for (alone or in hybrid drafting), ``model_*`` the rest."""

    steps: int = 0  # target forwards: the first reads the prompt, each later one verifies a step's drafts
    drafted_tokens: int = 0  # cells drafted over all rows
    verified_tokens: int = 0  # drafts the target checked
    accepted_tokens: int = 0  # verified drafts accepted before the first rejection
    emitted_tokens: int = 0  # tokens added to the outputs, after stopping criteria
    draft_seconds: float = 0.0  # wall time of the draft side of the loop
    verify_seconds: float = 0.0  # and of the target side
    target_tokens: int = 0  # tokens the target's forwards computed after the prompt's (padded: to the longest block)
    selected_tokens: int = 0  # what a packed read computes: the verified drafts plus one token per active row
    num_drafted_per_step: list[int] = field(default_factory=list)  # K that step
    budget_per_step: list[int] = field(default_factory=list)
    verified_per_step: list[list[int]] = field(default_factory=list)  # [s][r], r an original batch row
    accepted_per_step: list[list[int]] = field(default_factory=list)  # [s][r]
    target_tokens_per_step: list[int] = field(default_factory=list)  # 0 at the prompt's step
    lookup_drafted_tokens: int = 0
    lookup_verified_tokens: int = 0
    lookup_accepted_tokens: int = 0
    lookup_drafted_per_step: list[int] = field(default_factory=list)
    lookup_accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def verification_success_rate(self) -> float:
        """VSR: accepted / verified draft tokens."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    @property
    def model_drafted_tokens(self) -> int:
        """Cells a draft model or EAGLE head drafted (the rows lookup did not draft for)."""
        return self.drafted_tokens - self.lookup_drafted_tokens

    @property
    def model_verified_tokens(self) -> int:
        return self.verified_tokens - self.lookup_verified_tokens

    @property
    def model_accepted_tokens(self) -> int:
        return self.accepted_tokens - self.lookup_accepted_tokens

    @property
    def computed_per_selected(self) -> float:
        """Tokens the target computed per token selected (1.0: no padding)."""
        return self.target_tokens / self.selected_tokens if self.selected_tokens else 0.0

    @classmethod
    def from_steps(cls, records, batch_size: int) -> "TetrisStats":
        """Totals and per-step lists from the loop's step records (their tensors read from the device in one go).

        Args:
            records: :class:`~tetris_hf.step.StepRecord` s, one per step; ``rows``, ``verify_lengths``,
                ``num_accepted``, ``emitted``, ``drafted_lengths`` and ``by_lookup`` are ``(B_active,)`` tensors.
            batch_size: rows of the ``generate()`` call.
        """
        stats = cls(steps=len(records))
        if not records:
            return stats
        sizes = [record.rows.numel() for record in records]
        columns = [torch.cat([getattr(record, name).long().cpu() for record in records])
                   for name in ("rows", "verify_lengths", "num_accepted", "emitted", "drafted_lengths", "by_lookup")]
        rows, verified, accepted, emitted, drafted, by_lookup = torch.stack(columns).tolist()
        stats.drafted_tokens = sum(drafted)
        stats.verified_tokens, stats.accepted_tokens, stats.emitted_tokens = sum(verified), sum(accepted), sum(emitted)
        stats.draft_seconds = sum(record.seconds.draft for record in records)
        stats.verify_seconds = sum(record.seconds.verify for record in records)
        stats.target_tokens_per_step = [record.target_tokens for record in records]
        stats.target_tokens = sum(stats.target_tokens_per_step)
        stats.selected_tokens = stats.verified_tokens + sum(sizes[1:])  # (the prompt's step verifies nothing)
        stats.num_drafted_per_step = [record.num_drafted for record in records]
        stats.budget_per_step = [record.budget for record in records]
        stats.lookup_verified_tokens = sum(v for v, lookup in zip(verified, by_lookup) if lookup)
        start = 0
        for size in sizes:
            step_verified, step_accepted = [-1] * batch_size, [-1] * batch_size
            for index in range(start, start + size):
                step_verified[rows[index]], step_accepted[rows[index]] = verified[index], accepted[index]
            stats.verified_per_step.append(step_verified)
            stats.accepted_per_step.append(step_accepted)
            step = range(start, start + size)
            stats.lookup_drafted_per_step.append(sum(drafted[i] for i in step if by_lookup[i]))
            stats.lookup_accepted_per_step.append(sum(accepted[i] for i in step if by_lookup[i]))
            start += size
        stats.lookup_drafted_tokens = sum(stats.lookup_drafted_per_step)
        stats.lookup_accepted_tokens = sum(stats.lookup_accepted_per_step)
        return stats

    def to_dict(self) -> dict:
        """The fields and the derived rates and counts, by name."""
        derived = ("acceptance_rate", "verification_success_rate", "computed_per_selected", "model_drafted_tokens",
                   "model_verified_tokens", "model_accepted_tokens")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass
class TetrisGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` (``sequences`` ``(B, T)``) with ``tetris_stats`` (:class:`TetrisStats`)."""

    tetris_stats: TetrisStats | None = None
