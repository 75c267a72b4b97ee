"""Acceptance learnt online, one table of rates per drafter: what prompt lookup's, suffix drafts' and the hybrid's
model cells are ranked by (:class:`~.prompt_lookup.LookupAcceptance`, :class:`~.suffix.SuffixAcceptance`,
:class:`~.hybrid.DraftAcceptance`), on the device."""

from __future__ import annotations

import torch


class OnlineRates:
    """A table of acceptance rates, the table's shape ``prior``'s: cell ``c``'s estimate is
    ``(accepted + s * prior_c) / (tried + s)`` (``s = prior_strength``), counted over the cells the target reached;
    counts decay by ``memory`` per step."""

    def __init__(self, prior: torch.Tensor, prior_strength: float, memory: float):
        self.prior, self.prior_strength, self.memory = prior, prior_strength, memory
        self.tried = torch.zeros(prior.shape, device=prior.device)
        self.accepted = torch.zeros(prior.shape, device=prior.device)

    def rates(self) -> torch.Tensor:
        """Every cell's estimated acceptance (the table's shape)."""
        return (self.accepted + self.prior_strength * self.prior) / (self.tried + self.prior_strength)

    def count(self, index: torch.Tensor, tried: torch.Tensor, accepted: torch.Tensor) -> None:
        """Count one step: drafted cells at flat table positions ``index``, which the target ``tried`` (the cells
        before them were accepted) and ``accepted`` (bool, ``index``'s shape)."""
        index = index.flatten()
        self.tried.mul_(self.memory).view(-1).index_add_(0, index, tried.flatten().float())
        self.accepted.mul_(self.memory).view(-1).index_add_(0, index, accepted.flatten().float())
