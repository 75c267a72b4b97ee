"""Our drafters as transformers ``CandidateGenerator``s (:class:`CandidateGeneratorAPI`): ``get_candidates`` and
``update_candidate_strategy`` on the batched protocol, so that transformers' own assisted decoding (one row) drafts
with a draft model, prompt lookup or an EAGLE head. What that loop does with them: docs/design.md, section "The drafter
protocol".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..options import TetrisOptions
from ..step import ReadHints, Verdict


class _Candidates(NamedTuple):
    """The last ``get_candidates`` answer, awaiting the target: ``ids`` ``(1, T + count)``, input then drafts."""

    ids: torch.Tensor
    length: int  # T
    count: int
    cached_lengths: torch.Tensor | None = None  # (1,) the drafter's cache fill after drafting (None: no cache)


class CandidateGeneratorAPI(CandidateGenerator):
    """transformers' ``CandidateGenerator`` on top of a :class:`~.drafter.Drafter` (one row). ``num_assistant_tokens``:
    drafts per call (``k >= 1``); ``max_length``: drafts stop at ``max_length - 1`` tokens (``None``: no limit)."""

    num_assistant_tokens: int = TetrisOptions.num_assistant_tokens
    max_length: int | None = None
    reads_target_features = False  # drafts from the target's hidden states (an EAGLE head): see model_outputs below
    _given_features: torch.Tensor | None = None  # (1, W, F) those of the last verify forward (take_target_outputs)
    _candidates: _Candidates | None = None  # the answer the target has not ruled on
    _seen: torch.Tensor | None = None  # (1, T) the sequence the drafter stands at, no candidates pending

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft after ``input_ids`` ``(1, T)``, the whole sequence so far. Returns ``candidate_ids`` ``(1, T + k)``
        (``input_ids`` then ``k`` drafts) and ``candidate_logits`` ``(1, k, V)``, ``log q`` of sampled drafts
        (``None`` for deterministic drafts and ``k = 0``)."""
        self._check_usable(input_ids)
        if self.reads_target_features:
            if not self.take_target_outputs(kwargs.get("model_outputs"), kwargs.get("is_first_iteration", True)):
                # no target forward yet: decode one step plainly, whose forward reads the prompt (its features)
                self.prefill(input_ids, torch.ones_like(input_ids), all_real=True)
                self._candidates, self._seen = _Candidates(input_ids, input_ids.shape[1], 0), None
                return input_ids, None
        if not self._settle(input_ids):
            self.prefill(input_ids, torch.ones_like(input_ids), all_real=True)
        length = input_ids.shape[1]
        num_tokens = self._num_candidates(length)
        sequences = torch.cat([input_ids, input_ids.new_zeros(1, num_tokens)], dim=1)
        lengths = torch.full((1,), length, dtype=torch.long, device=input_ids.device)
        proposal = self.propose(sequences, lengths, num_tokens, confidences=False)
        count = num_tokens if proposal.lengths is None else int(proposal.lengths[0])
        candidates = sequences[:, : length + count]
        self._candidates, self._seen = _Candidates(candidates, length, count, proposal.cached_lengths), None
        # no q (deterministic drafts) or no drafts: None (for k = 0 the loop's sampling would take the whole sequence)
        if count == 0 or proposal.probs is None:
            return candidates, None
        return candidates, proposal.probs[:, :count].log()

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor | None, num_matches: int):
        """The target's verdict on the last candidates: ``input_ids`` ``(1, T')`` is the last input, ``num_matches``
        accepted candidates (``T' - T - 1``, else ``ValueError``) and the target's token; ``scores`` is not needed."""
        last = self._candidates
        if last is not None and int(num_matches) != input_ids.shape[1] - last.length - 1:
            raise ValueError(f"`num_matches` ({int(num_matches)}) does not fit `input_ids`: the last candidates "
                             f"followed {last.length} tokens, so {input_ids.shape[1]} tokens hold "
                             f"{input_ids.shape[1] - last.length - 1} accepted candidates and the target's token")
        if not self.reads_target_features:  # (a head settles at the next get_candidates, with the forward's outputs)
            self._settle(input_ids)

    def take_target_outputs(self, model_outputs, is_first_iteration: bool) -> bool:
        """Take the hidden states of the forward that verified the last candidates (an EAGLE head); False when there
        are none yet. Here: refused (a drafter that reads them beside another source, which this loop cannot drive)."""
        raise ValueError("this drafter reads the target's hidden states beside another source, which transformers' "
                         "assisted decoding cannot drive: use `target.generate(..., assistant_model=head, "
                         "custom_generate=\"tetris\")`")

    def _check_usable(self, input_ids: torch.Tensor) -> None:
        """Refuse what transformers' one-row loop cannot drive, before anything runs."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"get_candidates drafts for one row, as transformers' assisted decoding runs (its "
                             f"`num_matches` is one number), got input_ids of shape {tuple(input_ids.shape)}: for "
                             f"batches use `target.generate(..., custom_generate=\"tetris\")`")
        k = self.num_assistant_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`num_assistant_tokens` must be an integer >= 1, got {k!r}")

    def _num_candidates(self, length: int) -> int:
        """Drafts after ``length`` tokens: ``num_assistant_tokens``, leaving room for the target's token under
        ``max_length``."""
        if self.max_length is None:
            return self.num_assistant_tokens
        return max(min(self.num_assistant_tokens, self.max_length - length - 1), 0)

    def _settle(self, input_ids: torch.Tensor) -> bool:
        """Bring the drafter to ``input_ids`` ``(1, T')`` if they continue what it last saw (the verdict on the
        pending candidates, once); False when they do not (the caller prefills)."""
        last = self._candidates
        if last is not None:
            self._candidates = None
            new_length = input_ids.shape[1]
            accepted = new_length - last.length - 1
            # E.g. T = 5, candidates [d1 d2 d3]: input_ids [x1..x5 d1 t] (T' = 7) accepted d1; x1..x5 d1 must match
            if not (0 <= accepted <= last.count and torch.equal(input_ids[:, : new_length - 1],
                                                                 last.ids[:, : new_length - 1])):
                return False
            live = last.cached_lengths
            device = input_ids.device
            self.accept(Verdict(  # (what it asks the loop to read for it, it does without: one row, ≤ 2 columns)
                num_accepted=torch.tensor([accepted], device=device),
                next_tokens=input_ids[:, -1],
                verify_lengths=torch.tensor([last.count], device=device),  # the loop verifies every candidate
                hints=ReadHints(max_accepted=accepted, cached_longest=None if live is None else int(live.max())),
                features=self._given_features,
            ))
            self._seen = input_ids
            return True
        seen = self._seen
        if seen is None or seen.shape != input_ids.shape:
            return False
        return seen is input_ids or torch.equal(seen, input_ids)
