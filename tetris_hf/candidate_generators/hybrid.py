"""Hybrid drafting (:class:`HybridCandidateGenerator`): prompt lookup (or suffix drafts) where a row finds a match, a
draft model or EAGLE head where it does not, one verification for both, every cell ranked by its calibrated estimate
of acceptance (:class:`DraftAcceptance` for the model's). Design and why sampling stays lossless: docs/design.md,
section "Hybrid drafting".
"""

from __future__ import annotations

import torch

from .batched_draft import BatchedDraftCandidateGenerator
from .calibration import OnlineRates
from .drafter import Drafter, JoiningRows, PromptChunk, Proposal, Retired, RowMoves, Verdict, check_chains
from .prompt_lookup import BatchedPromptLookupCandidateGenerator
from .suffix import SuffixCandidateGenerator


class DraftAcceptance(OnlineRates):
    """A draft model's confidences calibrated online: ``P(cell accepted | the cells before it were)`` as a function of
    the cell's ``max q``, in ``num_bins`` equal bins (an :class:`~.calibration.OnlineRates` table whose prior is each
    bin's centre), interpolated linearly between bin centres."""

    def __init__(self, device: torch.device, num_bins: int = 10, prior_strength: float = 4.0, memory: float = 0.99):
        super().__init__((torch.arange(num_bins, dtype=torch.float32, device=device) + 0.5) / num_bins,
                         prior_strength, memory)
        self.num_bins = num_bins

    def log_probs(self, draft_log_probs: torch.Tensor) -> torch.Tensor:
        """``(B, K)`` log estimated acceptance of cells whose ``log max q`` is ``draft_log_probs`` ``(B, K)``."""
        rates = self.rates()
        position = (draft_log_probs.float().exp() * self.num_bins - 0.5).clamp(0, self.num_bins - 1)
        low = position.floor().long()
        high = (low + 1).clamp(max=self.num_bins - 1)
        weight = position - low
        return (rates[low] * (1 - weight) + rates[high] * weight).log()

    def update(self, draft_log_probs: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor,
               rows: torch.Tensor) -> None:
        """Count one step's model cells: ``draft_log_probs`` ``(B, K)`` their ``log max q``; rows ``rows`` ``(B,)``
        (bool: those the model drafted for) verified ``verify_lengths`` and accepted ``num_accepted`` ``(B,)``."""
        cells = torch.arange(draft_log_probs.shape[1], device=draft_log_probs.device)[None, :]
        tried = (cells < verify_lengths[:, None]) & (cells <= num_accepted[:, None]) & rows[:, None]
        bins = (draft_log_probs.float().exp() * self.num_bins).long().clamp(0, self.num_bins - 1)
        self.count(bins, tried, tried & (cells < num_accepted[:, None]))


class HybridCandidateGenerator(Drafter):
    """The model-free ``lookup`` (prompt lookup or suffix drafts, ``K`` at most its ``max_tokens``) and a draft model's
    or EAGLE head's drafter ``model`` drafting together, a source per row each step."""

    def __init__(self, lookup: BatchedPromptLookupCandidateGenerator | SuffixCandidateGenerator,
                 model: BatchedDraftCandidateGenerator):
        self.lookup, self.model = lookup, model
        self.reads_target_features = model.reads_target_features
        self.feature_layers = model.feature_layers
        self.pack = model.pack
        self.calibration: DraftAcceptance | None = None
        # the last proposal, until its verdict: (B, K) cells, (B,) lookup rows, (B, K) the model's log max q or None
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        self.lookup.prefill(input_ids, attention_mask, all_real)
        self.model.prefill(input_ids, attention_mask, all_real)
        self.calibration = DraftAcceptance(input_ids.device)

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int,
                rows: torch.Tensor | None = None, confidences: bool = True, *, lookup_only: bool = False,
                tree_width: int = 1) -> Proposal:
        """Both parts draft ``K = num_tokens`` cells after each row of ``sequences`` ``(B, T)`` (valid up to ``lengths``
        ``(B,)``); a row keeps lookup's where lookup matched, the model's elsewhere.

        Returns:
            A :class:`~.drafter.Proposal`: ``tokens`` ``(B, K)``; ``log_probs`` ``(B, K)`` log estimated acceptance
            (lookup's estimate, or the model's ``max q`` calibrated); ``probs`` ``(B, K, V)`` when sampling, one-hot
            at the drafted token in lookup rows; ``lengths`` ``(B,)`` lookup's count or ``K``; ``lookup_rows``
            ``(B,)``. With ``lookup_only``, lookup alone (:meth:`_propose_lookup`).
        """
        check_chains(self, tree_width)
        if lookup_only:
            return self._propose_lookup(sequences, lengths, num_tokens, rows, confidences)
        # lookup first: a model whose processors read the prefix writes each draft before scoring the next
        looked = self.lookup.propose(sequences, lengths, num_tokens, rows, confidences)
        drafted = self.model.propose(sequences, lengths, num_tokens, rows, confidences)
        if num_tokens == 0:
            self._last = None
            return drafted
        from_lookup = looked.lengths > 0  # (B,)
        tokens = torch.where(from_lookup[:, None], looked.tokens, drafted.tokens)
        sequences.scatter_(1, lengths[:, None] + torch.arange(num_tokens, device=lengths.device), tokens)
        log_probs = None
        if confidences:
            calibrated = self.calibration.log_probs(drafted.log_probs)
            log_probs = torch.where(from_lookup[:, None], looked.log_probs, calibrated)
        probs = None
        if drafted.probs is not None:  # sampling: lookup's q is one-hot at its draft
            one_hot = torch.zeros_like(drafted.probs).scatter_(2, tokens[..., None], 1.0)
            probs = torch.where(from_lookup[:, None, None], one_hot, drafted.probs)
        self._last = (tokens, from_lookup, drafted.log_probs)
        return Proposal(tokens, log_probs, probs, torch.where(from_lookup, looked.lengths, num_tokens), from_lookup,
                        drafted.cached_lengths)

    def _propose_lookup(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int,
                        rows: torch.Tensor | None, confidences: bool) -> Proposal:
        """Lookup alone drafts where a row matches (the model runs no forward); ``probs`` ``None``."""
        if num_tokens == 0:
            return self.propose(sequences, lengths, 0, rows, confidences)
        looked = self.lookup.propose(sequences, lengths, num_tokens, rows, confidences)
        idle = self.model.propose(sequences, lengths, 0, rows, confidences)  # (its draft count this step: none)
        from_lookup = looked.lengths > 0
        self._last = (looked.tokens, from_lookup, None)
        return Proposal(looked.tokens, looked.log_probs, None, looked.lengths, from_lookup, idle.cached_lengths)

    def accept(self, verdict: Verdict) -> torch.Tensor | None:
        """Both parts learn the verdict: lookup its estimates, the calibration the model's cells, and the model rolls
        back to each row's accepted cells, whoever drafted them (returning what it asks the loop to read)."""
        self.lookup.accept(verdict)
        if self._last is None:  # the prompt's read or a plain step: nothing was drafted
            return self.model.accept(verdict)
        cells, from_lookup, model_log_probs = self._last
        self._last = None
        if model_log_probs is not None:
            self.calibration.update(model_log_probs, verdict.verify_lengths, verdict.num_accepted, ~from_lookup)
        return self.model.accept_cells(verdict, cells, from_lookup)

    def settle(self, read: int | None, finished: Retired | None = None, moves: RowMoves | None = None) -> None:
        self.lookup.settle(None, finished, moves)
        self.model.settle(read, finished, moves)

    def join(self, rows: JoiningRows | None = None, chunk: PromptChunk | None = None) -> torch.Tensor | None:
        self.lookup.join(rows, chunk)
        return self.model.join(rows, chunk)

    def catch_up(self) -> None:
        self.model.catch_up()
