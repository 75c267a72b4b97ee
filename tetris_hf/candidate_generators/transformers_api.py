"""Our drafters as transformers ``CandidateGenerator``s: ``get_candidates`` and ``update_candidate_strategy`` built on
the batched protocol (:meth:`~.drafter.Drafter.prefill`, ``propose``, ``accept``), so that transformers' own assisted
decoding (``GenerationMixin._assisted_decoding``, one row) can draft with a draft model, prompt lookup or an EAGLE
head. An EAGLE head drafts from the target's hidden states: it declares ``requires_model_outputs`` (with
``model_kwargs_overrides = {"output_hidden_states": [the layers it reads]}``), and the loop hands it each verify forward's outputs
(``model_outputs``) at the next ``get_candidates``, where it reads the target's verdict on its last candidates.

What that loop does with a candidate generator (transformers 5.23, ``generation/utils.py``, ``_assisted_decoding``):

- every iteration calls ``get_candidates(input_ids)`` with the whole sequence so far, ``(1, T)``, and takes back
  ``candidate_ids`` ``(1, T + k)`` (``input_ids`` followed by ``k`` drafts; ``k = 0``: decode plainly) and
  ``candidate_logits`` ``(1, k, V)`` or ``None``;
- it keeps the first ``n`` candidates the target agrees with and the target's token after them, so the next
  ``input_ids`` is ``n + 1`` tokens longer (the last step may crop at ``max_length`` or EOS: then ``n`` is what it
  kept minus one, and the loop ends), and calls ``update_candidate_strategy(input_ids, scores, n)`` with those;
- with ``requires_model_outputs`` it calls ``get_candidates(input_ids, model_outputs=..., is_first_iteration=...,
  ...)`` instead, the outputs of the forward that verified the last candidates (``None`` at the first iteration,
  before any target forward), and adds ``model_kwargs_overrides`` to each verify forward's inputs;
- greedy ignores ``candidate_logits``; sampling with them runs speculative sampling with
  ``q = softmax(candidate_logits)`` (so we return ``log q``, the drafter's processed ``q``), and without them
  (deterministic drafts, prompt lookup) samples the target at every candidate and keeps those it matched.

Drafts per call: :attr:`CandidateGeneratorAPI.num_assistant_tokens` (tetris' default ``k``; set it on the drafter),
never past :attr:`CandidateGeneratorAPI.max_length` ``- 1`` when that is set (else the loop's own crop applies).
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
    """transformers' ``CandidateGenerator`` on top of a :class:`~.drafter.Drafter` (one row).

    The first ``get_candidates`` prefills the drafter with the whole input; each later one (or the
    ``update_candidate_strategy`` before it) hands the drafter the target's verdict on the last candidates, read off
    the new ``input_ids`` (``n = T' - T - 1`` accepted, the target's token last), then proposes again. Any input
    that does not continue the last candidates (another prompt, a second ``generate`` call) starts over. Unlike the
    batched protocol, these calls read the device (a prefix comparison, the drafter's fill, prompt lookup's count),
    as transformers' one-row loop itself does every step.

    Attributes:
        num_assistant_tokens: drafts per call (``k >= 1``), as transformers' ``num_assistant_tokens``.
        max_length: the call's ``max_length``; drafts stop at ``max_length - 1`` tokens (``None``: no limit here).
    """

    num_assistant_tokens: int = TetrisOptions.num_assistant_tokens
    max_length: int | None = None
    reads_target_features = False  # drafts from the target's hidden states (an EAGLE head): see model_outputs below
    _given_features: torch.Tensor | None = None  # (1, W, F) those of the last verify forward (take_target_outputs)
    _candidates: _Candidates | None = None  # the answer the target has not ruled on
    _seen: torch.Tensor | None = None  # (1, T) the sequence the drafter stands at, no candidates pending

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft after ``input_ids``.

        Args:
            input_ids: ``(1, T)`` the whole sequence so far (prompt and accepted tokens).

        Returns:
            ``candidate_ids`` ``(1, T + k)``: ``input_ids`` then ``k`` drafts (``k`` from :attr:`num_assistant_tokens`
            and :attr:`max_length`; prompt lookup may find fewer, or none).
            ``candidate_logits`` ``(1, k, V)``: ``log q`` of the distributions sampled drafts were drawn from;
            ``None`` for deterministic drafts (greedy, prompt lookup) and when ``k = 0``.
        """
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
        # no q (deterministic drafts) or no drafts: None, which the loop needs for k = 0 (its speculative sampling
        # would take candidate_ids[:, -0:], the whole sequence, for the drafts)
        if count == 0 or proposal.probs is None:
            return candidates, None
        return candidates, proposal.probs[:, :count].log()

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor | None, num_matches: int):
        """The target's verdict on the last candidates: the drafter rolls back to the accepted ones.

        Args:
            input_ids: ``(1, T')`` the sequence after the step: the last input, ``num_matches`` accepted candidates and
                the target's token.
            scores: ``(1, k + 1, V)`` the target's processed scores (not needed: ``input_ids`` says it all).
            num_matches: candidates accepted; must be ``T' - T - 1``.
        """
        last = self._candidates
        if last is not None and int(num_matches) != input_ids.shape[1] - last.length - 1:
            raise ValueError(f"`num_matches` ({int(num_matches)}) does not fit `input_ids`: the last candidates "
                             f"followed {last.length} tokens, so {input_ids.shape[1]} tokens hold "
                             f"{input_ids.shape[1] - last.length - 1} accepted candidates and the target's token")
        if not self.reads_target_features:  # (a head settles at the next get_candidates, with the forward's outputs)
            self._settle(input_ids)

    def take_target_outputs(self, model_outputs, is_first_iteration: bool) -> bool:
        """A drafter that reads the target's hidden states (an EAGLE head) takes those of the forward that verified its
        last candidates, ``model_outputs`` (with ``hidden_states``, as ``model_kwargs_overrides`` asks); returns
        False when there are none yet (the first iteration of a call). Here: a drafter that reads them but cannot take
        them from transformers' loop (an EAGLE head beside prompt lookup) is refused."""
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
        ``max_length`` (as transformers' ``AssistedCandidateGenerator`` does)."""
        if self.max_length is None:
            return self.num_assistant_tokens
        return max(min(self.num_assistant_tokens, self.max_length - length - 1), 0)

    def _settle(self, input_ids: torch.Tensor) -> bool:
        """Bring the drafter to ``input_ids`` ``(1, T')`` if they continue what it last saw: hand it the verdict on
        the pending candidates (once). False when they do not (a new sequence: the caller prefills)."""
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
