"""The draft side: a small model proposes ``K`` tokens (or a tree) for every active row of a left-padded batch
(:class:`BatchedDraftCandidateGenerator`), keeping its own :class:`~tetris_hf.kv.SlotCache` and a left-padded block of
tokens it has not read yet. Design: docs/design.md, section "The drafter protocol".
"""

from __future__ import annotations

import math

import torch

from ..compiled import check_compilable, compiled_forward
from ..kv import SlotCache
from ..logits import PositionwiseLogitsProcessor, sample_tokens, vocab_argmax
from ..tree_logits import process_at_nodes
from ..trees import DraftTree, GrownTree, ancestor_mask, grow_tree, path_tokens
from .drafter import Drafter, JoiningRows, PromptChunk, Proposal, Retired, RowMoves, Verdict


def pending_read(mask: torch.Tensor) -> torch.Tensor:
    """A left-padded pending block's ``mask`` ``(B, P)`` as one 0-d integer for the loop's end-of-step read:
    ``widest + (P + 1) * total`` (the most real tokens a row holds, and their sum).

    E.g. mask ``[[0 1], [1 1]]``: widest 2, total 3 -> 2 + 3 * 3 = 11.
    """
    counts = mask.sum(dim=1)
    return counts.max() + (mask.shape[1] + 1) * counts.sum()


def split_pending_read(read: int, columns: int) -> tuple[int, int | None]:
    """``(widest, total)`` from a :func:`pending_read` of a block of ``columns`` columns; a plain width (at most
    ``columns``) gives ``(width, None)``."""
    if read <= columns:
        return read, None
    return read % (columns + 1), read // (columns + 1)


def final_tokens(cells: torch.Tensor, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
    """What a verdict made final in each row, ``[c1 .. ca, t]`` (the first ``num_accepted`` of ``cells`` ``(B, K)``,
    then the target's token), as ``(B, W)`` tokens and mask, real first (``W = min(max_accepted, K) + 1``).

    E.g. cells ``[[x1 x2], [y1 y2]]``, 2 and 0 accepted, tokens t and u: ``[[x1 x2 t], [u . .]]``, mask
    ``[[1 1 1], [1 0 0]]``."""
    num_accepted, next_tokens, max_accepted = verdict.num_accepted, verdict.next_tokens, verdict.hints.max_accepted
    width = (cells.shape[1] if max_accepted is None else min(max_accepted, cells.shape[1])) + 1
    tokens = torch.cat([cells[:, : width - 1], next_tokens[:, None]], dim=1)
    tokens = tokens.scatter(1, num_accepted[:, None], next_tokens[:, None])  # t right after the accepted cells
    mask = (torch.arange(width, device=num_accepted.device)[None, :] <= num_accepted[:, None]).long()
    return tokens, mask


def left_packed_order(mask: torch.Tensor) -> torch.Tensor:
    """``(B, P)`` the column order that left-packs a block with filler anywhere in ``mask`` ``(B, P)``.

    E.g. mask ``[[0 1 1 0], [1 0 1 1]]`` -> ``[[0 3 1 2], [1 0 2 3]]``."""
    return mask.argsort(dim=1, stable=True)


def real_tokens(mask: torch.Tensor, all_real: bool) -> int:
    """The real tokens of ``mask`` ``(B, T)`` on the host: a device read unless ``all_real`` says every one is."""
    return mask.numel() if all_real else int(mask.sum())


class BatchedDraftCandidateGenerator(Drafter):
    """A draft model (``assistant_model``, the target's vocabulary) proposing for a batch whose rows advance
    independently: the batched counterpart of transformers' ``AssistedCandidateGenerator``.

    Args:
        logits_processor: the target's processors, applied to the draft's logits too (``q`` estimates the processed
            ``p``).
        do_sample, generator: draw drafts from ``q`` (else take its argmax).
        max_holes, capacity: see :class:`~tetris_hf.kv.SlotCache`; compile: ``tetris_compile``.
        max_rows: the most rows its cache will hold, where rows join later (a stream's; 0: the prompts').
    """

    def __init__(self, assistant_model: torch.nn.Module, logits_processor: PositionwiseLogitsProcessor,
                 do_sample: bool, generator: torch.Generator | None = None, max_holes: int = 32, capacity: int = 256,
                 compile: bool = False, max_rows: int = 0):
        if compile:
            check_compilable(assistant_model, "draft")
        self.compile_steps = compile
        self.assistant_model = assistant_model
        self.logits_processor = logits_processor
        self.do_sample = do_sample
        self.generator = generator
        self.max_holes = max_holes
        self.capacity = capacity
        self.slots: SlotCache | None = None
        self.pending_tokens: torch.Tensor | None = None  # (B, P) left-padded
        self.pending_mask: torch.Tensor | None = None  # (B, P)
        self.pending_real = False  # known on the host: every pending token is real (the next forward needs no mask)
        self.pack = False  # read blocks with filler packed: set where the draft model packs exactly (build_drafter)
        self.max_rows = max_rows
        # stop a chain once every row's draft is less sure than this (tetris_confidence_threshold; build_drafter)
        self.stop_below: float | None = None
        self.pending_count: int | None = None  # real pending tokens, known on the host (None: not known, read padded)
        self._last_draft: torch.Tensor | None = None  # (B, 1) the K-th draft of the last proposal (never fed)
        self._last_num_drafted = 0
        self._ones: torch.Tensor | None = None  # (B, 1) ones, the pending mask of the target's token (rows only leave)
        self._tree: tuple[int, int, int, torch.Tensor] | None = None  # the last tree: root slot, depth, width, tokens

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        """Start on ``(B, T)`` left-padded prompts (``all_real``: no padding): an empty cache, the prompt pending."""
        self._new_cache(input_ids)
        self.pending_tokens, self.pending_mask = input_ids, attention_mask.long()
        self.pending_real = all_real
        self.pending_count = real_tokens(attention_mask, all_real) if self.pack else None

    def _new_cache(self, input_ids: torch.Tensor) -> None:
        """An empty cache for ``input_ids``' rows (its step forwards compiled where asked)."""
        self.slots = SlotCache(input_ids.shape[0], input_ids.device, self.max_holes, self.capacity)
        self.slots.max_rows = max(self.slots.max_rows, self.max_rows)
        self.slots.pack = self.pack
        if self.compile_steps:
            self.slots.step_forward = compiled_forward(self.assistant_model)

    def catch_up(self) -> None:
        """Read the pending tokens but the last column into the cache (one forward; nothing for two columns or
        fewer), so that proposal times measure drafting alone."""
        if self.pending_tokens.shape[1] <= 2:
            return
        self.slots.prefill(self.assistant_model, self.pending_tokens, self.pending_mask, self.pending_count)
        self._pending_last_column()

    def _pending_last_column(self) -> None:
        """What a catch-up leaves pending: the last column, real in every row."""
        self.pending_tokens, self.pending_mask = self.pending_tokens[:, -1:], self.pending_mask[:, -1:]
        self.pending_real, self.pending_count = True, self.pending_tokens.shape[0]

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int, rows: torch.Tensor | None = None,
                confidences: bool = True, *, lookup_only: bool = False, tree_width: int = 1) -> Proposal | GrownTree:
        """Draft ``num_tokens`` tokens after each row, written into ``sequences`` past ``lengths`` (with
        ``tree_width > 1``, a tree: :meth:`propose_tree`; ``lookup_only`` means nothing to a draft alone).

        Args:
            sequences: ``(B, T)``, valid up to ``lengths`` ``(B,)``; ``T >= lengths.max() + num_tokens``, ``K >= 0``.
            rows: ``(B,)`` each row's index in the original batch (per-row processor state); default ``arange``.
            confidences: compute ``log_probs`` (else ``None``).

        Returns:
            A :class:`~.drafter.Proposal`: ``tokens`` ``(B, K)``; ``log_probs`` ``(B, K)`` ``log max_x q(x)``, which
            does not depend on the token drawn (ranking by the drawn token's ``q`` would bias sampling); ``probs``
            ``(B, K, V)`` the processed ``q`` when sampling, else ``None``; ``cached_lengths`` ``(B,)``.
        """
        if tree_width > 1:
            rows = torch.arange(sequences.shape[0], device=sequences.device) if rows is None else rows
            return self.propose_tree(sequences, lengths, num_tokens, tree_width, rows)
        batch_size = sequences.shape[0]
        self._last_num_drafted = num_tokens
        if num_tokens == 0:
            empty = torch.empty(batch_size, 0, device=sequences.device)
            return Proposal(empty.long(), (empty if confidences else None), None,
                            cached_lengths=self.slots.live_lengths())
        rows = torch.arange(batch_size, device=sequences.device) if rows is None else rows
        # Processors that read the tokens so far must see each draft before scoring the next; for the others the
        # drafts are written in one go at the end.
        write_each = not self.logits_processor.prefix_free
        draft_tokens, token_log_probs, draft_probs = self._draft_chain(sequences, lengths, num_tokens, rows,
                                                                       confidences, write_each)
        self._last_draft = draft_tokens[-1]
        self._last_num_drafted = len(draft_tokens)
        drafts = torch.cat(draft_tokens, dim=1)
        if not write_each:
            sequences.scatter_(1, lengths[:, None] + self.slots.offsets[: drafts.shape[1]], drafts)
        return Proposal(drafts, torch.cat(token_log_probs, dim=1) if confidences else None,
                        torch.cat(draft_probs, dim=1) if self.do_sample else None,
                        cached_lengths=self.slots.live_lengths())

    def _draft_chain(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int, rows: torch.Tensor,
                     confidences: bool, write_each: bool) -> tuple[list, list, list]:
        """The chain's forwards (the pending block first): lists of each step's ``(B, 1)`` tokens, ``(B, 1)``
        confidences and ``(B, 1, V)`` draft laws (sampling); shorter where :attr:`stop_below` stopped the chain."""
        tokens, mask = self.pending_tokens, (None if self.pending_real else self.pending_mask)
        draft_tokens, token_log_probs, draft_probs = [], [], []
        stop_below = None if self.stop_below is None else math.log(self.stop_below)
        for step in range(num_tokens):  # every tensor (B, 1, ...): one position per row
            logits = self._draft_forward(step, tokens, mask)
            scores = self.logits_processor(sequences, lengths, logits, rows, offset=step)
            log_probs = scores.log_softmax(dim=-1) if confidences or self.do_sample or stop_below is not None else None
            if self.do_sample:
                probs = log_probs.exp()
                next_tokens = sample_tokens(probs, self.generator)
                draft_probs.append(probs)
            else:
                next_tokens = vocab_argmax(scores)
            if write_each:
                sequences.scatter_(1, lengths[:, None] + step, next_tokens)
            draft_tokens.append(next_tokens)
            if confidences:  # amax: max(dim) would also find the indices, which nothing reads
                token_log_probs.append(log_probs.amax(dim=-1))
            tokens, mask = next_tokens, None  # the draft's own token: real in every row
            # (a device read: every row unsure of this draft, the chain stops here, its later cells unlikely)
            if stop_below is not None and step + 1 < num_tokens and bool((log_probs.amax(dim=-1) < stop_below).all()):
                break
        return draft_tokens, token_log_probs, draft_probs

    def propose_tree(self, sequences: torch.Tensor, lengths: torch.Tensor, depth: int, width: int,
                     rows: torch.Tensor) -> GrownTree:
        """Draft a tree of ``depth`` levels after each row (EAGLE-2's expansion, :func:`~tetris_hf.trees.grow_tree`) in
        ``depth`` forwards, each node processed on its own prefix; nothing is written into ``sequences``.

        ``sequences`` ``(B, T)``, valid up to ``lengths`` ``(B,)``, ``T >= lengths.max() + depth``; ``rows`` ``(B,)``
        original batch indices. Returns a :class:`~tetris_hf.trees.GrownTree` of ``width * depth`` nodes per row.
        """
        slots, processor = self.slots, self.logits_processor
        self._last_num_drafted = depth
        # every slot the tree writes, made room for now: repacking in the middle would move the nodes' ancestors
        slots.reserve(self.pending_tokens.shape[1] + (depth - 1) * width)
        logits = self._draft_forward(0, self.pending_tokens, None if self.pending_real else self.pending_mask)
        root_slot = slots.length - 1
        root_positions = slots.slot_positions[:, root_slot]
        root_log_probs = processor(sequences, lengths, logits, rows)[:, 0].log_softmax(dim=-1)

        def next_log_probs(tree: DraftTree, frontier: slice) -> torch.Tensor:
            # the frontier is the newest depth (nodes frontier.start .. frontier.stop - 1, the tree's last ones): they
            # go to slots root_slot + 1 + node, after their ancestors
            visibility = ancestor_mask(tree.parents)[:, frontier]  # (B, F, nodes so far)
            depths = tree.depths[:, frontier]
            node_logits = self._node_forward(tree.tokens[:, frontier], tree.parents[:, frontier],
                                             root_positions[:, None] + depths, visibility)
            paths = None if processor.prefix_free else \
                path_tokens(tree.tokens, tree.parents, tree.depths, depth)[:, frontier]
            return process_at_nodes(processor, sequences, lengths, rows, node_logits, paths, depths).log_softmax(-1)

        grown = grow_tree(root_log_probs, next_log_probs, depth, width, sample=self.do_sample,
                          generator=self.generator)
        self._tree = (root_slot, depth, width, grown.tree.tokens)
        return grown._replace(cached_lengths=slots.live_lengths())

    def _node_forward(self, tokens: torch.Tensor, parents: torch.Tensor, position_ids: torch.Tensor,
                      visibility: torch.Tensor) -> torch.Tensor:
        """A tree depth's forward: ``(B, F)`` frontier nodes (``parents`` ``(B, F)``, -1 for the root) at
        ``position_ids`` ``(B, F)``, seeing ``visibility`` ``(B, F, nodes so far)``; ``(B, F, V)`` logits."""
        return self.slots.forward(self.assistant_model, tokens, None, step=True, position_ids=position_ids,
                                  visibility=visibility)

    def _accept_tree(self, verdict: Verdict) -> None:
        """Roll the cache back to the accepted path of the last tree (kept nodes stay where they are, holes between)
        and queue what it has not read; ``verdict.tree.path_nodes`` ``(B, D)``, -1 after the path."""
        path_nodes, next_tokens = verdict.tree.path_nodes, verdict.next_tokens
        max_accepted, cached_longest = verdict.hints
        root_slot, depth, width, tokens = self._tree
        self._tree = None
        cached = (depth - 1) * width  # nodes in the cache: every depth but the last
        # E.g. width 2, depth 3 (nodes 0-3 cached at root_slot + 1 ..), path [1, 2, 5] -> keep [T, F, T, T, F]
        dump = cached + 1
        columns = torch.where((path_nodes >= 0) & (path_nodes < cached), path_nodes + 1, dump)
        keep = torch.zeros(path_nodes.shape[0], cached + 2, dtype=torch.bool, device=path_nodes.device)
        keep[:, 0] = True
        keep.scatter_(1, columns, True)
        self.slots.keep_slots(root_slot, keep[:, : cached + 1])
        ones = torch.ones_like(next_tokens[:, None])
        if max_accepted < depth:  # no row accepted a node of the last depth: only the target's token waits
            self._pending_target_tokens(next_tokens, ones)
        else:  # [last node, target token], the node masked where the path ends above it
            last = path_nodes[:, depth - 1]
            last_token = tokens.gather(1, last.clamp(min=0)[:, None])
            self.pending_tokens = torch.cat([last_token, next_tokens[:, None]], dim=1)
            self.pending_mask = torch.cat([(last >= 0).long()[:, None], ones], dim=1)
            self.pending_real, self.pending_count = False, None
        self.slots.compact(cached_longest)

    def _draft_forward(self, step: int, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Draft step ``step``'s forward over the pending block (step 0) or the last draft, ``(B, P or 1)``; returns
        the ``(B, 1, V)`` logits after its last token."""
        return self.slots.forward(self.assistant_model, tokens, mask, logits_to_keep=1, step=True,
                                  num_real=self.pending_count if step == 0 else None)

    def accept(self, verdict: Verdict) -> torch.Tensor | None:
        """Roll the draft cache back to what the target accepted; returns what the loop reads for :meth:`settle`."""
        self._roll_back(verdict)
        return self._to_read()

    def _to_read(self) -> torch.Tensor | None:
        """What the loop reads at the step's end for :meth:`settle` (:func:`pending_read`); ``None`` when every pending
        token is real."""
        return None if self.pending_real else pending_read(self.pending_mask)

    def _roll_back(self, verdict: Verdict) -> None:
        """Roll the draft cache back to ``verdict.num_accepted`` ``(B,)`` and queue what the draft has not read
        (``next_tokens`` ``(B,)``, and the K-th draft where a row accepted it)."""
        if verdict.tree is not None:
            self._accept_tree(verdict)
            return
        num_accepted, next_tokens = verdict.num_accepted, verdict.next_tokens
        max_accepted, cached_longest = verdict.hints
        drafted = self._last_num_drafted
        if self._ones is None:
            self._ones = torch.ones_like(next_tokens[:, None])
        ones = self._ones[: next_tokens.shape[0]]
        if drafted == 0:  # nothing was read: the old pending tokens still wait (left-packed), the new token joins
            self.pending_tokens = torch.cat([self.pending_tokens, next_tokens[:, None]], dim=1)
            self.pending_mask = torch.cat([self.pending_mask, ones], dim=1)
            self._add_to_count(self.pending_tokens.shape[0])  # (a plain step: one per row)
            return
        # The cache now holds the pending block, then drafts 1..K-1; keep the accepted ones among those.
        # E.g. K = 3, rows [p q | d1 d2] and [r s | e1 e2], 1 and 3 accepted: drafts start at slot 2, keep [1, 2] ->
        # [p q | d1 .] and [r s | e1 e2]; pending [d3 t] mask [0 1] (d3 rejected: filler), [e3 u] mask [1 1].
        first_draft_slot = self.slots.length - (drafted - 1)  # (drafts are real in every row)
        self.slots.keep_prefix(first_draft_slot, num_accepted.clamp(max=drafted - 1))
        if max_accepted is not None and max_accepted < drafted:  # no row accepted draft K: one column
            self._pending_target_tokens(next_tokens, ones)
        else:  # [draft K, target token], the draft filler where it was not accepted: left-padded as it stands
            all_accepted = (num_accepted == drafted).long()[:, None]  # draft K accepted but never read
            self.pending_tokens = torch.cat([self._last_draft, next_tokens[:, None]], dim=1)
            self.pending_mask = torch.cat([all_accepted, ones], dim=1)
            self.pending_real, self.pending_count = False, None  # (until the loop's read says, see settle)
        self.slots.compact(cached_longest)

    def accept_cells(self, verdict: Verdict, cells: torch.Tensor, foreign: torch.Tensor) -> torch.Tensor | None:
        """As :meth:`accept`, where rows ``foreign`` ``(B,)`` (bool) verified another drafter's cells (hybrid
        drafting): ``cells`` ``(B, K)`` the tokens every row verified. A foreign row keeps none of this draft's cached
        drafts and queues every token it accepted, then the target's.

        E.g. K = 3, own row ``[p | d1 d2]`` accepted 1, foreign row ``[r | e1 e2]`` accepted 2 lookup cells
        ``x1 x2``: caches ``[p | d1 .]`` and ``[r | . .]``; pending ``[. . t]`` and ``[x1 x2 u]``.
        """
        self._roll_back_cells(verdict, cells, foreign)
        return self._to_read()

    def _roll_back_cells(self, verdict: Verdict, cells: torch.Tensor, foreign: torch.Tensor) -> None:
        drafted = self._last_num_drafted
        if drafted == 0:  # this draft drafted nothing (lookup alone did): what every row made final waits
            self._queue_after_pending(*final_tokens(cells, verdict))
            return
        num_accepted, cached_longest = verdict.num_accepted, verdict.hints.cached_longest
        kept = torch.where(foreign, 0, num_accepted.clamp(max=drafted - 1))  # accepted drafts the cache holds
        self.slots.keep_prefix(self.slots.length - (drafted - 1), kept)
        final, _ = final_tokens(cells[:, :drafted], verdict)
        # (B,) accepted cells the draft has not read, then t
        self._queue_right_aligned(final, kept, num_accepted - kept + 1, cached_longest)

    def _queue_right_aligned(self, final: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                             cached_longest: int | None) -> torch.Tensor:
        """Wait with ``count`` ``(B,)`` tokens of ``final`` ``(B, W)`` from column ``first`` ``(B,)`` on, left-padded;
        then compact the cache. Returns ``(B, W)`` the column of ``final`` each pending column holds.

        E.g. W = 3, rows ``[x1 x2 t]`` from 0, 3 tokens and ``[x1 t .]`` from 1, 1 token: ``[x1 x2 t]`` and ``[. . t]``.
        """
        width = final.shape[1]
        columns = torch.arange(width, device=final.device)[None, :]
        source = (first[:, None] + columns - (width - count)[:, None]).clamp(min=0, max=width - 1)
        self.pending_tokens = final.gather(1, source)
        self.pending_mask = (columns >= (width - count)[:, None]).long()
        self.pending_real = width == 1
        self.pending_count = final.shape[0] if width == 1 else None  # (else until the loop's read says)
        self.slots.compact(cached_longest)
        return source

    def _queue_after_pending(self, tokens: torch.Tensor, mask: torch.Tensor) -> None:
        """``tokens`` ``(B, W)`` (real where ``mask``) wait after the pending ones, left-packed."""
        mask = torch.cat([self.pending_mask, mask], dim=1)
        order = left_packed_order(mask)
        self.pending_tokens = torch.cat([self.pending_tokens, tokens], dim=1).gather(1, order)
        self.pending_mask = mask.gather(1, order)
        self.pending_real, self.pending_count = False, None  # (until the loop's read says, see settle)

    def _pending_target_tokens(self, next_tokens: torch.Tensor, ones: torch.Tensor) -> None:
        """Only the target's tokens ``(B,)`` wait: one column, real in every row."""
        self.pending_tokens, self.pending_mask = next_tokens[:, None], ones
        self.pending_real, self.pending_count = True, next_tokens.shape[0]

    def _add_to_count(self, tokens: int) -> None:
        """``tokens`` more tokens wait (a plain step's, rows joining)."""
        if self.pending_count is not None:
            self.pending_count += tokens

    def settle(self, read: int | None, finished: Retired | None = None, moves: RowMoves | None = None) -> None:
        """``read`` (a :func:`pending_read`): keep the pending block's last ``widest`` columns and its real tokens'
        count; then rows leave as ``moves`` says."""
        if read is not None:
            self._trim_pending(read)
        if moves is not None:
            self._fill_rows(*moves)

    def _trim_pending(self, read: int) -> None:
        """Keep the last ``widest`` columns of the pending block and its real-token count (``read``: a
        :func:`pending_read`, or a plain width)."""
        width, total = split_pending_read(read, self.pending_tokens.shape[1])
        if total is not None:
            self.pending_count = total
        self._keep_pending_columns(width)

    def _keep_pending_columns(self, width: int) -> None:
        """Keep the last ``width`` columns of the pending block, which hold every pending token."""
        if 0 < width < self.pending_tokens.shape[1]:
            self.pending_tokens, self.pending_mask = self.pending_tokens[:, -width:], self.pending_mask[:, -width:]
        if width == 1:  # every row holds one pending token, the last column: real everywhere
            self.pending_real, self.pending_count = True, self.pending_tokens.shape[0]

    def join(self, rows: JoiningRows | None = None, chunk: PromptChunk | None = None) -> torch.Tensor | None:
        """Rows join with empty caches, their last tokens pending; a chunk of their prompts goes into the draft's
        cache. Returns what :meth:`accept` would now."""
        if rows is not None:
            self._add_rows(rows)
        if chunk is not None:
            self._read_prompts(chunk)
        return self._to_read()

    def _add_rows(self, rows: JoiningRows) -> None:
        """Rows join with empty caches, each one's last token pending (left-padded to the pending block's width)."""
        last_tokens = rows.last_tokens
        count, width = last_tokens.shape[0], self.pending_tokens.shape[1]
        self.slots.add_rows(count)
        joining = torch.nn.functional.pad(last_tokens[:, None], (width - 1, 0))
        joining_mask = torch.zeros_like(joining, dtype=self.pending_mask.dtype)
        joining_mask[:, -1] = 1
        self.pending_tokens = torch.cat([self.pending_tokens, joining])
        self.pending_mask = torch.cat([self.pending_mask, joining_mask])
        self.pending_real = self.pending_real and width == 1
        self._add_to_count(count)
        self._ones = None  # (sized for the rows there were)

    def _read_prompts(self, chunk: PromptChunk) -> None:
        """The joining rows' prompt chunk into the draft's cache (packed where the draft can be)."""
        self.slots.forward(self.assistant_model, chunk.tokens, None, real_lengths=chunk.real_lengths,
                           num_real=chunk.num_real, discard_logits=True, first_row=chunk.first_row)
        self.slots.compact(chunk.longest)

    def _fill_rows(self, targets: torch.Tensor, sources: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Finished rows leave (:meth:`~tetris_hf.kv.SlotCache.fill_rows`, whose row order this returns)."""
        rows = self.slots.fill_rows(targets, sources, num_rows)
        self.pending_tokens, self.pending_mask = self.pending_tokens[rows], self.pending_mask[rows]
        # rows left: the pending count is known only where every pending token is real
        self.pending_count = self.pending_tokens.numel() if self.pending_real else None
        return rows
