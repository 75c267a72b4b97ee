"""Where a greedy speculative output first differs from the target alone, and whether rounding can explain it.

In fp32 greedy speculative output equals the target's own greedy output token for token (the tests check it). In bf16
and fp16 it need not: a verification forward over a block of several tokens and a decoding forward over one token
round differently (other kernels, other summation orders), so where the target's two best tokens are nearly tied the
argmax can flip. Plain batched ``generate()`` against one row at a time has the same property. What is left to check
is that every difference sits at such a near-tie.

For each row this module finds the first generated token that differs from the reference (the target alone), runs
the target once on the reference's prefix up to there (one unpadded row, no cache, in the target's dtype), and reports

- ``margin``: the target's top-1 minus top-2 logit there (how near the tie is);
- ``gap``: the target's top-1 logit minus the logit of the token the speculative output chose there (equal to
  ``margin`` when that token is the runner-up; larger when it is not, which no near-tie explains).

A row passes if it is identical or ``gap <= tolerance``. The tolerance, in logits, is ``ULPS`` units in the last place
of the target's dtype at the scale of the top logit: ``ULPS * eps(dtype) * 2**floor(log2 |top logit|)``. In bf16
(8 significant bits, eps = 2**-7) every layer's output is rounded to 8 bits, so two computations of one logit differ
by a few units in the last place of the logit's magnitude after a deep network; we allow 8 (a top logit of 20 gives a
tolerance of 8 * 2**-7 * 16 = 1.0; in fp16, eps = 2**-10, the same logit gives 0.125). In fp32 the tolerance is 0:
any difference fails, as the fp32 tests require.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ULPS = 8
HALF_PRECISION = (torch.bfloat16, torch.float16)


def logit_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    """``ULPS`` units in the last place of ``dtype`` at ``|top_logit|`` for bf16/fp16; 0 otherwise (exact)."""
    if dtype not in HALF_PRECISION:
        return 0.0
    scale = 2.0 ** math.floor(math.log2(abs(top_logit))) if top_logit != 0 else 1.0
    return ULPS * torch.finfo(dtype).eps * scale


@dataclass(frozen=True)
class RowDivergence:
    """How one row of a speculative output compares with the reference.

    ``position`` is the index among the generated tokens (0 = the first new token) of the first difference, ``None``
    when the row is identical; the other fields are ``None`` then too. ``speculative_token`` is ``None`` when the
    speculative row ended there while the reference went on (and ``reference_token`` when the reference ended).
    """

    row: int
    position: int | None = None
    reference_token: int | None = None
    speculative_token: int | None = None
    margin: float | None = None
    gap: float | None = None
    tolerance: float | None = None
    dtype: str | None = None

    @property
    def identical(self) -> bool:
        return self.position is None

    @property
    def within_tolerance(self) -> bool:
        """Identical, or first differing at a near-tie that rounding in the target's dtype explains."""
        return self.identical or (self.gap is not None and self.gap <= self.tolerance)

    def describe(self) -> str:
        if self.identical:
            return f"row {self.row}: identical"
        verdict = "near-tie" if self.within_tolerance else "NOT a near-tie"
        gap = "n/a" if self.gap is None else f"{self.gap:.4g}"
        margin = "n/a" if self.margin is None else f"{self.margin:.4g}"
        return (f"row {self.row}: first differs at new token {self.position} (reference {self.reference_token}, "
                f"speculative {self.speculative_token}); top-2 margin {margin}, gap {gap}, tolerance "
                f"{self.tolerance:.4g} ({self.dtype}): {verdict}")


def first_difference(speculative: list[int], reference: list[int]) -> int | None:
    """Index of the first token that differs, or where the shorter list ends; ``None`` when equal."""
    for index, (a, b) in enumerate(zip(speculative, reference)):
        if a != b:
            return index
    return None if len(speculative) == len(reference) else min(len(speculative), len(reference))


def split_sequences(sequences: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """``generate()`` output ``(B, T + N)`` and its prompt mask ``(B, T)`` -> (unpadded prompts, generated tokens)."""
    width = attention_mask.shape[1]
    prompts = [row[mask.bool()].tolist() for row, mask in zip(sequences[:, :width], attention_mask)]
    return prompts, sequences[:, width:].tolist()


@torch.no_grad()
def compare_outputs(
    target: torch.nn.Module,
    prompts: list[list[int]],
    speculative: list[list[int]],
    reference: list[list[int]],
) -> list[RowDivergence]:
    """Per row: identical, or the first divergence with the target's margin there and the verdict's tolerance.

    Args:
        target: the target model (its dtype sets the tolerance).
        prompts: each row's prompt tokens, without padding.
        speculative: each row's generated tokens from speculative decoding.
        reference: each row's generated tokens from the target alone (plain ``generate()``).

    Returns:
        One :class:`RowDivergence` per row.
    """
    device = target.get_input_embeddings().weight.device
    checks = []
    for row, (prompt, ours, theirs) in enumerate(zip(prompts, speculative, reference)):
        position = first_difference(ours, theirs)
        if position is None:
            checks.append(RowDivergence(row))
            continue
        ids = torch.tensor([prompt + theirs[:position]], device=device)
        logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1]  # (V,) in the target's dtype
        top = logits.topk(2).values.float()
        top_logit = float(top[0])
        chosen = ours[position] if position < len(ours) else None
        gap = None if chosen is None or chosen >= logits.shape[0] else top_logit - float(logits[chosen].float())
        checks.append(RowDivergence(
            row, position,
            reference_token=theirs[position] if position < len(theirs) else None,
            speculative_token=chosen,
            margin=float(top[0] - top[1]),
            gap=gap,
            tolerance=logit_tolerance(target.dtype, top_logit),
            dtype=str(target.dtype).removeprefix("torch."),
        ))
    return checks
