"""What a TETRIS ``generate()`` call returns: the usual output plus ``tetris_stats``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class TetrisStats:
    """Counts of one batched speculative ``generate()`` call.

    Totals: ``steps`` (target forwards: the first reads the prompt and emits one token per row, as ``generate()``'s
    first forward does; each later one verifies a step's drafts), ``drafted_tokens`` (draft proposals over all rows),
    ``verified_tokens`` (drafts the target checked), ``accepted_tokens`` (verified drafts accepted before the first
    rejection), ``emitted_tokens`` (tokens added to the outputs, after stopping criteria). ``draft_seconds`` and
    ``verify_seconds``: wall time of the draft and of the target side of the loop.

    Per step ``s`` (lists of length ``steps``): ``num_drafted_per_step[s]`` (``K`` that step), ``budget_per_step[s]``,
    and per original batch row ``r``: ``verified_per_step[s][r]`` and ``accepted_per_step[s][r]`` (``-1`` for rows
    that had already finished).
    """

    steps: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    num_drafted_per_step: list[int] = field(default_factory=list)
    budget_per_step: list[int] = field(default_factory=list)
    verified_per_step: list[list[int]] = field(default_factory=list)
    accepted_per_step: list[list[int]] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def verification_success_rate(self) -> float:
        """VSR: accepted / verified draft tokens."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "verification_success_rate": self.verification_success_rate,
        }


@dataclass
class TetrisGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` (``sequences`` ``(B, T)``) with ``tetris_stats`` (:class:`TetrisStats`)."""

    tetris_stats: TetrisStats | None = None
