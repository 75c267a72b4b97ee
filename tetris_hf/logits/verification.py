"""Accept or reject drafted tokens against the target, per row, losslessly (docs/design.md, "Verification").

``L`` is the longest verified block; the target's scores have ``L + 1`` positions, position ``j`` predicting the token
after draft ``j``. The functions return ``num_accepted`` ``(B,)`` (drafts accepted before the first rejection) and
``next_tokens`` ``(B,)`` (the target's token after them): row ``i`` emits ``drafts[i, :num_accepted[i]]``, then
``next_tokens[i]``.
"""

from __future__ import annotations

import torch

from .argmax import vocab_argmax


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` bool -> ``(B,)`` number of leading True values per row."""
    return flags.long().cumprod(dim=-1).sum(dim=-1)


def verify_greedy(draft_tokens: torch.Tensor, verify_lengths: torch.Tensor, target_scores: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest prefix equal to the target's argmax, then add the target's own token.

    Args:
        draft_tokens: ``(B, L)`` drafted tokens (entries past ``verify_lengths`` are ignored).
        verify_lengths: ``(B,)``.
        target_scores: ``(B, L + 1, V)`` processed target scores.

    Returns:
        ``(num_accepted, next_tokens)``, both ``(B,)``.
    """
    block_length = draft_tokens.shape[1]
    if block_length == 0:  # nothing verified (a plain step): the target's token
        return torch.zeros_like(verify_lengths), vocab_argmax(target_scores[:, 0])
    target_tokens = vocab_argmax(target_scores)  # (B, L + 1)
    # Drafts past a row's verified length are not candidates: its accepted count stops there.
    num_accepted = torch.minimum(_leading_true(draft_tokens == target_tokens[:, :block_length]), verify_lengths)
    next_tokens = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_tokens


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ``(..., V)``, drawn from it without a device sync (unlike
    ``torch.multinomial``): the argmax of ``p / E`` with ``E ~ Exp(1)`` i.i.d. is distributed as ``p``."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return vocab_argmax(probs / noise.clamp(min=torch.finfo(probs.dtype).tiny))


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm(max(p - q, 0))`` over the last dimension, the distribution to sample after a rejection (``p`` where
    rounding leaves no positive mass), and its mass ``sum max(p - q, 0)``, the probability that ``x ~ q`` is rejected.

    Args:
        target_probs, draft_probs: ``(..., V)``.

    Returns:
        ``(..., V)`` the residual distribution and ``(...)`` its mass.
    """
    residual = (target_probs - draft_probs).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    normalised = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target_probs)
    return normalised, mass.squeeze(-1)


def verify_sampling(draft_tokens: torch.Tensor, verify_lengths: torch.Tensor, target_scores: torch.Tensor,
                    draft_probs: torch.Tensor | None, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), every row in one batched pass: accept draft
    ``j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``, at the first rejection sample from ``norm(max(p - q, 0))``,
    else a bonus token from the next ``p``.

    Args:
        draft_tokens: ``(B, L)``.
        verify_lengths: ``(B,)``.
        target_scores: ``(B, L + 1, V)`` processed target scores (``-inf`` allowed).
        draft_probs: ``(B, L, V)`` the distributions the drafts were sampled from; ``None`` for deterministic drafts
            (prompt lookup: ``q`` one-hot at the draft).
        generator: optional random generator.

    Returns:
        ``(num_accepted, next_tokens)``, both ``(B,)``.
    """
    target_probs = target_scores.softmax(dim=-1)
    batch_size, block_length = draft_tokens.shape
    if block_length == 0:  # nothing verified (a plain step): a token from p
        num_accepted = torch.zeros(batch_size, dtype=torch.long, device=draft_tokens.device)
        return num_accepted, sample_tokens(target_probs[:, 0], generator)
    rows = torch.arange(batch_size, device=draft_tokens.device)
    p_of_draft = target_probs[:, :block_length].gather(2, draft_tokens[..., None]).squeeze(2)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    uniform = torch.rand(p_of_draft.shape, generator=generator, device=p_of_draft.device)
    accepted = uniform * q_of_draft < p_of_draft  # u < p/q without dividing by q
    positions = torch.arange(block_length, device=draft_tokens.device)
    num_accepted = _leading_true(accepted & (positions[None, :] < verify_lengths[:, None]))
    next_target = target_probs[rows, num_accepted]  # (B, V)
    rejected = num_accepted < verify_lengths
    rejected_cell = num_accepted.clamp(max=block_length - 1)
    if draft_probs is None:  # one-hot at the rejected draft
        draft_at_rejection = torch.zeros_like(next_target).scatter_(1, draft_tokens[rows, rejected_cell, None], 1.0)
    else:
        draft_at_rejection = draft_probs[rows, rejected_cell]
    next_target = torch.where(rejected[:, None], residual_distribution(next_target, draft_at_rejection)[0], next_target)
    return num_accepted, sample_tokens(next_target, generator)


def verify(drafts: torch.Tensor, verify_lengths: torch.Tensor, target_scores: torch.Tensor,
           draft_probs: torch.Tensor | None, do_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop's acceptance rule: :func:`verify_greedy`, or :func:`verify_sampling` when ``do_sample``.

    Args:
        drafts: ``(B, L)`` the verified drafts (a prefix ``verify_lengths`` ``(B,)`` of each row is real).
        target_scores: ``(B, L + 1, V)`` the target's processed scores at each verified position and after them.
        draft_probs: ``(B, >= L, V)`` the distributions sampled drafts came from (``None``: deterministic drafts).

    Returns:
        ``(num_accepted, next_tokens)``, both ``(B,)``.
    """
    if not do_sample:
        return verify_greedy(drafts, verify_lengths, target_scores)
    if draft_probs is not None:
        draft_probs = draft_probs[:, : drafts.shape[1]]
    return verify_sampling(drafts, verify_lengths, target_scores, draft_probs)
