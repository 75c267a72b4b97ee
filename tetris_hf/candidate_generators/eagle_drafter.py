"""An EAGLE head drafting for a batch (:class:`EagleCandidateGenerator`): the target's own features in, draft tokens
out; drafted positions are dropped after verification and the accepted tokens re-read with the target's features.
Alignment and a worked example: docs/design.md, section "EAGLE heads".
"""

from __future__ import annotations

import torch

from ..logits import PositionwiseLogitsProcessor
from .batched_draft import BatchedDraftCandidateGenerator, final_tokens, left_packed_order, real_tokens
from .drafter import JoiningRows, PromptChunk, Verdict
from .eagle import HEAD_OUTPUT, EagleDraft, select_features


class EagleCandidateGenerator(BatchedDraftCandidateGenerator):
    """:class:`~.batched_draft.BatchedDraftCandidateGenerator` for an EAGLE ``head`` (on the target's device and
    dtype): the pending block carries the target's features ``(B, P, F)``, drafted steps read the head's output."""

    reads_target_features = True
    # transformers' assisted decoding hands the head each verify forward's outputs, with the hidden states it reads
    requires_model_outputs = True

    def __init__(self, head: EagleDraft, logits_processor: PositionwiseLogitsProcessor, do_sample: bool,
                 generator: torch.Generator | None = None, max_holes: int = 32, capacity: int = 256,
                 compile: bool = False, max_rows: int = 0):
        super().__init__(head, logits_processor, do_sample, generator, max_holes, capacity, compile, max_rows)
        self.head = head
        self._feature_tail: list[torch.Tensor] = []  # plain steps' features, joined to the block's when it is read
        self.pending_features = None
        self._prompt: tuple[torch.Tensor, torch.Tensor] | None = None  # (input_ids, mask) until the prompt's features
        self._drafts: torch.Tensor | None = None  # (B, K) the last proposal's tokens
        self._out: torch.Tensor | None = None  # (B, 1, H) the head's output at its last position
        self._tree_out: torch.Tensor | None = None  # (B, 1 + N, H) while a tree grows: at the root and its nodes
        self.feature_layers = tuple(head.aux_layer_ids)  # what every target forward returns for the head
        self.model_kwargs_overrides = {"output_hidden_states": list(self.feature_layers)}

    @property
    def pending_features(self) -> torch.Tensor | None:
        """``(B, P, F)`` the target's features of the pending block. Plain steps queue one column each, kept apart
        and joined when the block is next read, so that a plain step does not copy the whole block (docs/
        benchmarks.md, "The matrix again")."""
        if self._feature_tail:
            self._pending_features = torch.cat([self._pending_features, *self._feature_tail], dim=1)
            self._feature_tail = []
        return self._pending_features

    @pending_features.setter
    def pending_features(self, features: torch.Tensor | None) -> None:
        self._pending_features, self._feature_tail = features, []

    @staticmethod
    def _features(verdict: Verdict | PromptChunk) -> torch.Tensor:
        """``(B, W, F)`` the target's features over the block its forward read, as the verdict (or chunk) carries."""
        if verdict.features is None:
            raise ValueError("an EAGLE head needs the target's features of every target forward: run the target's "
                             "forwards with output_hidden_states=list(head.aux_layer_ids) and pass them in the "
                             "verdict's `features`")
        return verdict.features

    def take_target_outputs(self, model_outputs, is_first_iteration: bool) -> bool:
        """transformers' assisted decoding: keep the features of the forward that verified the last candidates;
        False at a call's first iteration, before any target forward."""
        if is_first_iteration or model_outputs is None:
            self._given_features = None
            return False
        if getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("the target's forward returned no hidden states: an EAGLE head needs "
                             "`output_hidden_states=True` in it (its `model_kwargs_overrides`)")
        self._given_features = select_features(model_outputs.hidden_states, self.feature_layers)
        return True

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        """Wait for the prompt's features (the target's prompt forward, handed to the first :meth:`accept`)."""
        self._new_cache(input_ids)
        self._prompt = (input_ids, attention_mask.long())
        self.pending_real = all_real
        self.pending_count = real_tokens(attention_mask, all_real) if self.pack else None  # (the prompt's block)

    def catch_up(self) -> None:
        """Read the pending block but its last column (which opens the next proposal)."""
        if self.pending_tokens.shape[1] <= 2:
            return
        self.slots.prefill(self.head, self.pending_tokens, self.pending_mask, self.pending_count,
                           row_inputs={"target_features": self.pending_features})
        self.pending_features = self.pending_features[:, -1:]
        self._pending_last_column()

    def _draft_forward(self, step: int, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # the pending block with the target's features, or the last draft with the head's own output before it
        inputs = {"target_features": self.pending_features} if step == 0 else {"draft_features": self._out}
        logits, out = self.slots.forward(self.head, tokens, mask, logits_to_keep=1, step=True,
                                         num_real=self.pending_count if step == 0 else None, row_inputs=inputs,
                                         hidden_states=HEAD_OUTPUT)
        self._out = out[:, -1:]
        return logits

    def propose_tree(self, sequences, lengths, depth, width, rows):  # (propose with tree_width > 1)
        self._tree_out = None  # (B, 1 + nodes so far, H) the head's output at the root and each expanded node
        grown = super().propose_tree(sequences, lengths, depth, width, rows)
        self._tree_out = None
        return grown

    def _node_forward(self, tokens: torch.Tensor, parents: torch.Tensor, position_ids: torch.Tensor,
                      visibility: torch.Tensor) -> torch.Tensor:
        """A tree depth: each node with the head's output at its parent (the position that drafted it)."""
        if self._tree_out is None:
            self._tree_out = self._out  # the root's, from the pending block's forward
        out = self._tree_out
        draft_features = out.gather(1, (parents + 1)[..., None].expand(-1, -1, out.shape[-1]))
        logits, node_out = self.slots.forward(self.head, tokens, None, step=True, position_ids=position_ids,
                                              visibility=visibility, row_inputs={"draft_features": draft_features},
                                              hidden_states=HEAD_OUTPUT)
        self._tree_out = torch.cat([out, node_out], dim=1)
        return logits

    def _accept_tree(self, verdict: Verdict) -> None:
        """Drop every drafted node; queue the accepted path and the target's token with the target's features at the
        root and the path's nodes."""
        features, path_nodes, path_slots = self._features(verdict), verdict.tree.path_nodes, verdict.tree.path_slots
        max_accepted = verdict.hints.max_accepted
        root_slot, depth, _, tokens = self._tree
        self._tree = None
        keep = torch.zeros_like(self.slots.slot_mask[:, root_slot : self.slots.length])
        keep[:, 0] = True  # the pending block's last token, read with the target's feature
        self.slots.keep_slots(root_slot, keep)
        # Queue the path's tokens and t with the target's features at block slots [0, path 1 .. a].
        width = min(max_accepted, depth) + 1
        path_tokens = tokens.gather(1, path_nodes[:, : width - 1].clamp(min=0))
        root = torch.zeros((path_slots.shape[0], 1), dtype=path_slots.dtype, device=path_slots.device)  # block slot 0
        feature_slots = torch.cat([root, path_slots[:, : width - 1].clamp(min=0)], 1)  # (path_slots may be (B, 0))
        path_features = features.gather(1, feature_slots[..., None].expand(-1, -1, features.shape[-1]))
        self._queue_final(path_tokens, verdict, path_features)

    def propose(self, sequences, lengths, num_tokens, rows=None, confidences=True, *, lookup_only=False,
                tree_width=1):
        proposal = super().propose(sequences, lengths, num_tokens, rows, confidences, tree_width=tree_width)
        if tree_width == 1:
            self._drafts = proposal.tokens
        return proposal

    def _roll_back(self, verdict: Verdict) -> None:
        """Drop the drafted entries and queue what the target made final with its features over the block it just
        read (the prompt, a verified block, or a plain step's token)."""
        if verdict.tree is not None:
            self._accept_tree(verdict)
            return
        num_accepted, next_tokens = verdict.num_accepted, verdict.next_tokens
        # (the forward may have read rows after the verdict's: prompts of rows joining a stream, the chunk's part)
        features = self._features(verdict)[: next_tokens.shape[0]]
        ones = torch.ones_like(next_tokens[:, None])
        if self._prompt is not None:  # the prompt's read: [x1 .. x_{T-1}, t] with [f0 .. f_{T-1}]
            input_ids, mask = self._prompt
            self._prompt = None
            self.pending_tokens = torch.cat([input_ids[:, 1:], next_tokens[:, None]], dim=1)
            self.pending_mask, self.pending_features = mask, features
            return
        drafted = self._last_num_drafted
        if drafted == 0:  # a plain step: [t] with the feature of the token before it joins what waits
            self.pending_tokens = torch.cat([self.pending_tokens, next_tokens[:, None]], dim=1)
            self.pending_mask = torch.cat([self.pending_mask, ones], dim=1)
            self._feature_tail.append(features[:, :1])  # (joined when the block is read: see pending_features)
            self._add_to_count(self.pending_tokens.shape[0])  # (a plain step: one per row)
            return
        # The cache holds the old pending block, then drafts 1..K-1 (read with the head's own features): drop those.
        if drafted > 1:
            self.slots.keep_prefix(self.slots.length - (drafted - 1), torch.zeros_like(num_accepted))
        self._queue_final(self._drafts[:, :drafted], verdict, features)  # [d1 .. da, t] with [f_n .. f_{n+a}]

    def _roll_back_cells(self, verdict: Verdict, cells: torch.Tensor, foreign: torch.Tensor) -> None:
        """As :meth:`_roll_back`, queueing ``cells`` ``(B, K)`` (every row's verified tokens, whoever drafted them;
        ``foreign`` ``(B,)`` is not needed: every drafted entry is dropped anyway)."""
        if self._last_num_drafted > 0:
            self._drafts = cells
            self._roll_back(verdict)
            return
        # the head drafted nothing (lookup alone did): what every row made final waits, each token with the target's
        # feature of the token before it (the block's columns 0 .. a)
        tokens, mask = final_tokens(cells, verdict)
        features = self._features(verdict)[: tokens.shape[0], : tokens.shape[1]]
        self._set_pending(torch.cat([self.pending_tokens, tokens], dim=1), torch.cat([self.pending_mask, mask], dim=1),
                          torch.cat([self.pending_features, features], dim=1))

    def _queue_final(self, candidates: torch.Tensor, verdict: Verdict, features: torch.Tensor) -> None:
        """Queue ``[x1 .. xa, t]`` (:func:`~.batched_draft.final_tokens` of ``candidates`` ``(B, K)``), each with its
        column of ``features`` ``(B, >= W, F)``, left-padded; then compact the cache.

        E.g. W = 3, a = [0, 2]: rows [. . t] and [x1 x2 t], features [. . f0] and [f0 f1 f2].
        """
        final, _ = final_tokens(candidates, verdict)
        num_accepted = verdict.num_accepted
        source = self._queue_right_aligned(final, torch.zeros_like(num_accepted), num_accepted + 1,
                                           verdict.hints.cached_longest)
        self.pending_features = features.gather(1, source[..., None].expand(-1, -1, features.shape[-1]))

    def _add_rows(self, rows: JoiningRows) -> None:
        """Rows join with empty caches and nothing pending (their prompt chunks queue ``[x1 .. x(P-1)]`` with
        ``[f0 .. f(P-2)]``, :meth:`_read_prompts`); a one-token prompt waits with ``[x0]`` and a zero feature."""
        last_tokens, prompt_lengths = rows
        count = last_tokens.shape[0]
        self.slots.add_rows(count)
        self._prompt = None  # a stream's rows come through here, not through a prompt read
        self._drafts, self._ones = None, None
        if self.pending_tokens is None:  # the stream's first rows
            self.pending_tokens = last_tokens.new_zeros(0, 1)
            self.pending_mask = last_tokens.new_zeros(0, 1)
            self.pending_features = torch.zeros(0, 1, self.head.feature_size, dtype=self.head.dtype,
                                                device=last_tokens.device)
        width = self.pending_tokens.shape[1]
        single = torch.tensor([length == 1 for length in prompt_lengths], device=last_tokens.device)
        tokens = last_tokens.new_zeros(count, width)
        tokens[:, -1] = last_tokens
        mask = last_tokens.new_zeros(count, width)
        mask[:, -1] = single.long()
        features = self.pending_features.new_zeros(count, width, self.pending_features.shape[-1])
        self._set_pending(torch.cat([self.pending_tokens, tokens]), torch.cat([self.pending_mask, mask]),
                          torch.cat([self.pending_features, features]))

    def _read_prompts(self, chunk: PromptChunk) -> None:
        """Queue the chunk's pairs (each position's successor, the target's feature there) after what waits."""
        tokens, real_lengths = chunk.tokens, chunk.real_lengths
        features = self._features(chunk)[:, : tokens.shape[1]]  # (B, L, F), zeros at filler
        mask = (torch.arange(tokens.shape[1], device=tokens.device)[None, :] < real_lengths[:, None]).long()
        self._set_pending(torch.cat([self.pending_tokens, chunk.next_tokens], dim=1),
                          torch.cat([self.pending_mask, mask], dim=1),
                          torch.cat([self.pending_features, features.to(self.pending_features.dtype)], dim=1))

    def _set_pending(self, tokens: torch.Tensor, mask: torch.Tensor, features: torch.Tensor) -> None:
        """Wait with these ``(B, W)`` tokens and mask and ``(B, W, F)`` features, left-packed."""
        order = left_packed_order(mask)
        self.pending_tokens, self.pending_mask = tokens.gather(1, order), mask.gather(1, order)
        self.pending_features = features.gather(1, order[..., None].expand(-1, -1, features.shape[-1]))
        self.pending_real, self.pending_count = False, None  # (counted again by the loop's end-of-step read)

    def _keep_pending_columns(self, width: int) -> None:
        if 0 < width < self.pending_tokens.shape[1]:
            self.pending_features = self.pending_features[:, -width:]
        super()._keep_pending_columns(width)

    def _fill_rows(self, targets: torch.Tensor, sources: torch.Tensor, num_rows: int) -> torch.Tensor:
        rows = super()._fill_rows(targets, sources, num_rows)
        self.pending_features = self.pending_features[rows]
        if self._drafts is not None:
            self._drafts = self._drafts[rows]
        return rows
