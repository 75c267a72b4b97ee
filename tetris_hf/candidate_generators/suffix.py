"""Suffix drafts for every row of a batch (``tetris_suffix_num_tokens=k``, :class:`SuffixCandidateGenerator`): the
continuation most often seen after the row's recent tokens, in the batch's own rows and in a
:class:`~tetris_hf.suffix_cache.SuffixCache` of earlier requests, ranked by vote share calibrated online
(:class:`SuffixAcceptance`); chains, or trees when alone. Design and why it is lossless: docs/design.md, section
"Suffix drafts".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..kv import rows_after_fill
from ..suffix_cache import (PEER_BUDGET, SUFFIX_DEPTH, SuffixCache, batch_continuations, batch_matches,
                            frequency_chain, frequency_tree, longest_match, own_match_lengths, suffix_keys)
from ..trees import GrownTree
from .calibration import OnlineRates
from .drafter import Drafter, JoiningRows, PromptChunk, Proposal, Retired, RowMoves, Verdict

# calibration groups by how many tokens a cell's occurrences agree with the row on: the match and the cells before
# the cell (a chain's third cell after a 2-token match: 4), 1, 2-3, 4-7 and 8 and more
LENGTH_CLASSES = (1, 2, 4, 8)


class SuffixAcceptance(OnlineRates):
    """A suffix cell's vote share calibrated online: ``P(cell accepted | the cells before it were)`` by the share's
    bin (``num_bins`` equal ones), whether the vote was unanimous (every occurrence still agreeing had the cell's
    token: one occurrence, or all alike) and the class (:data:`LENGTH_CLASSES`) of the cell's context, the tokens its
    occurrences agree with the row on once the cells before it are accepted (the match length plus its level: deeper
    cells of a path the target follows are accepted more often than first cells of the same share), an
    :class:`~.calibration.OnlineRates` table whose prior is each bin's centre."""

    def __init__(self, device: torch.device, num_bins: int = 10, prior_strength: float = 4.0, memory: float = 0.99):
        centres = (torch.arange(num_bins, dtype=torch.float32, device=device) + 0.5) / num_bins
        super().__init__(centres.expand(len(LENGTH_CLASSES), 2, num_bins), prior_strength, memory)
        self.num_bins = num_bins
        self.bounds = torch.tensor(LENGTH_CLASSES[1:], device=device)

    def cells(self, shares: torch.Tensor, unanimous: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """``(B, K)`` flat table index of cells with vote ``shares``, ``unanimous`` (bool) and ``context`` tokens
        agreed (the match length plus the cell's level), all ``(B, K)``."""
        length_class = torch.bucketize(context, self.bounds, right=True)
        bins = (shares * self.num_bins).long().clamp(0, self.num_bins - 1)
        return (length_class * 2 + unanimous.long()) * self.num_bins + bins

    def log_probs(self, shares: torch.Tensor, unanimous: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """``(B, K)`` log estimated acceptance."""
        return self.rates().flatten()[self.cells(shares, unanimous, context)].log()

    def update(self, shares: torch.Tensor, unanimous: torch.Tensor, ngram: torch.Tensor, drafted: torch.Tensor,
               verify_lengths: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Count one chain step: cells with ``shares`` and ``unanimous`` ``(B, K)``, rows that matched ``ngram`` and
        drafted ``drafted`` ``(B,)`` cells, verified ``verify_lengths`` and accepted ``num_accepted`` ``(B,)``."""
        cells = torch.arange(shares.shape[1], device=shares.device)[None, :]
        tried = (cells < verify_lengths[:, None]) & (cells <= num_accepted[:, None]) & (cells < drafted[:, None])
        self.count(self.cells(shares, unanimous, chain_context(ngram, shares.shape[1])), tried,
                   tried & (cells < num_accepted[:, None]))


def chain_context(ngram: torch.Tensor, num_cells: int) -> torch.Tensor:
    """``(B, K)`` each chain cell's context: the match length ``ngram`` ``(B,)`` plus the cells before it."""
    return ngram[:, None] + torch.arange(num_cells, device=ngram.device)[None, :]


class SuffixChain(NamedTuple):
    """:meth:`SuffixCandidateGenerator.draft`'s chains, every field ``(B, K)`` but ``counts`` and ``ngram`` ``(B,)``."""

    tokens: torch.Tensor  # past a row's count: its last token
    counts: torch.Tensor  # cells drafted (cut where the survival falls below min_prob)
    shares: torch.Tensor  # vote shares count / (total + 1)
    unanimous: torch.Tensor  # bool: every occurrence still agreeing had the cell's token
    ngram: torch.Tensor  # the match length
    log_probs: torch.Tensor  # each cell's calibrated log acceptance


class SuffixCandidateGenerator(Drafter):
    """Suffix drafting, driven through :class:`~.drafter.Drafter`; alone or as the model-free part of
    :class:`~.hybrid.HybridCandidateGenerator`.

    Args:
        max_tokens: the most cells any proposal drafts (``k + e``).
        cache: the :class:`~tetris_hf.suffix_cache.SuffixCache` to share (else a new one).
        occurrences: occurrences that vote, from the batch and from the cache each.
        depth: the longest match (the cache's, when given).
        min_prob: a cell is drafted only while its calibrated survival (the estimated chance that it and every cell
            before it are accepted) is at least this (a tree's node: its path's); 0 drafts every cell found.
    """

    def __init__(self, max_tokens: int = 8, cache: SuffixCache | None = None, occurrences: int = 32,
                 depth: int = SUFFIX_DEPTH, min_prob: float = 0.1):
        self.max_tokens = max_tokens
        self.min_log_prob = math.log(min_prob) if min_prob > 0 else float("-inf")
        self.cache = cache
        self.depth = depth if cache is None else cache.depth
        self.occurrences = occurrences
        self.starts: torch.Tensor | None = None  # (B,) first real column of each active row
        self.row_starts: torch.Tensor | None = None  # (B_call,) the same by original row (a call's left padding)
        self.width = 0  # a host bound on the rows' lengths
        self.acceptance: SuffixAcceptance | None = None
        # the last proposal, until its verdict: (B,) match lengths, (B, K) vote shares and unanimity (a tree's
        # (B, N)), (B,) cells drafted (a tree's: None)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self._depth = 0  # the last proposal's K (a host number), until its verdict

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        length = input_ids.shape[1]
        self.starts = length - attention_mask.long().sum(dim=1)  # left-padded: padding comes first
        self.row_starts = self.starts.clone()
        self.width = length
        device = input_ids.device
        if self.cache is None:
            self.cache = SuffixCache(depth=self.depth, device=device)
        elif self.cache.device != device:
            self.cache.to(device)
        self.acceptance = SuffixAcceptance(device)

    def find_occurrences(self, sequences: torch.Tensor, lengths: torch.Tensor,
                    num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's voting occurrences: ``candidates`` ``(B, C, K)`` the ``K`` tokens after each (the batch's then
        the cache's, ``-1`` past an end), ``found`` ``(B, C)`` and ``ngram`` ``(B,)`` the match length (0: none)."""
        width = min(self.width, sequences.shape[1])
        rows = sequences.shape[0]
        peers = rows * rows * width * self.depth <= PEER_BUDGET  # (else each row searches itself only)
        context, tokens = batch_matches(sequences[:, :width], self.starts, lengths, self.depth, peers)
        batch_match = context.amax(dim=1).long()  # (B,)
        query = suffix_keys(sequences, self.starts, lengths, self.depth)  # (d, B)
        with self.cache.lock:
            lo, hi = self.cache.ranges(query)
            cached_match = longest_match((hi - lo).sum(dim=1))  # (B,)
            ngram = torch.maximum(batch_match, cached_match)
            # a row whose own text matches as far as any other does drafts from its own text alone
            own_only = own_match_lengths(context, tokens.shape[1]) >= ngram
            from_cache, cache_found = self.cache.continuations(
                lo, hi, torch.where(~own_only & (cached_match >= ngram), ngram, 0), self.occurrences, num_tokens)
        from_batch, batch_found = batch_continuations(tokens, context, ngram, self.occurrences, num_tokens, own_only)
        return torch.cat([from_batch, from_cache], dim=1), torch.cat([batch_found, cache_found], dim=1), ngram

    def draft(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int) -> SuffixChain:
        """The :class:`SuffixChain` of every row."""
        candidates, found, ngram = self.find_occurrences(sequences, lengths, num_tokens)
        drafts, counts, chosen, total = frequency_chain(candidates, found)
        shares, unanimous = chosen / (total + 1), (chosen == total) & (chosen > 0)
        log_probs = self.acceptance.log_probs(shares, unanimous, chain_context(ngram, num_tokens))
        if self.min_log_prob > float("-inf"):  # (survival only falls along a chain: what is kept is a prefix)
            counts = torch.minimum(counts, (log_probs.cumsum(dim=1) >= self.min_log_prob).sum(dim=1))
        last = sequences.gather(1, (lengths - 1)[:, None])
        cells = torch.arange(num_tokens, device=sequences.device)[None, :]
        drafts = torch.where(cells < counts[:, None], drafts, last)
        return SuffixChain(drafts, counts, shares, unanimous, ngram, log_probs)

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int,
                rows: torch.Tensor | None = None, confidences: bool = True, *, lookup_only: bool = False,
                tree_width: int = 1) -> Proposal | GrownTree:
        """Draft ``K = num_tokens`` cells after each row of ``sequences`` ``(B, T)`` (valid up to ``lengths``
        ``(B,)``), written into ``sequences[i, lengths[i]:]``; with ``tree_width > 1`` a tree (:meth:`propose_tree`).

        Returns:
            A :class:`~.drafter.Proposal`: ``tokens`` ``(B, K)``; ``log_probs`` ``(B, K)`` calibrated log
            acceptance (``-inf`` past a row's count); ``probs`` ``None`` (one-hot at the draft); ``lengths`` ``(B,)``
            cells drafted; ``lookup_rows`` every row (model-free cells).
        """
        if tree_width > 1:
            return self.propose_tree(sequences, lengths, num_tokens, tree_width)
        if num_tokens == 0:
            empty = sequences.new_zeros(sequences.shape[0], 0)
            self._last, self._depth = None, 0
            return Proposal(empty, empty.float() if confidences else None, None, None)
        self._check_size(num_tokens)
        chain = self.draft(sequences, lengths, num_tokens)
        drafts, counts = chain.tokens, chain.counts
        cells = torch.arange(num_tokens, device=lengths.device)
        sequences.scatter_(1, lengths[:, None] + cells, drafts)
        self._last, self._depth = (chain.ngram, chain.shares, chain.unanimous, counts), num_tokens
        log_probs = None
        if confidences:
            log_probs = chain.log_probs.masked_fill(cells[None, :] >= counts[:, None], float("-inf"))
        return Proposal(drafts, log_probs, None, counts, torch.ones_like(counts, dtype=torch.bool))

    def propose_tree(self, sequences: torch.Tensor, lengths: torch.Tensor, depth: int, width: int) -> GrownTree:
        """A :class:`~tetris_hf.trees.GrownTree` of ``K = depth`` levels of ``width`` nodes per row
        (:func:`~tetris_hf.suffix_cache.frequency_tree`), scored by their path's calibrated log acceptance;
        ``expanded_log_probs`` ``None`` (sampling verifies it by matching). Nothing is written into ``sequences``."""
        self._check_size(depth)
        candidates, found, ngram = self.find_occurrences(sequences, lengths, depth)
        tree, shares, unanimous = frequency_tree(
            candidates, found, width,
            lambda share, agree, level: self.acceptance.log_probs(share, agree, ngram[:, None] + level))
        if self.min_log_prob > float("-inf"):  # (a path's score never rises: what is kept stays ancestor-closed)
            tree = tree._replace(valid=tree.valid & (tree.log_scores >= self.min_log_prob))
        self._last, self._depth = (ngram, shares, unanimous, None), depth
        return GrownTree(tree, None, None)

    def _check_size(self, num_tokens: int) -> None:
        if num_tokens > self.max_tokens:
            raise ValueError(f"asked for {num_tokens} suffix cells, the drafter was built for {self.max_tokens}")

    def accept(self, verdict: Verdict) -> None:
        """Calibrate on the verdict: a chain's cells up to the first rejection; a tree's verified nodes whose parent
        the accepted path reached."""
        max_accepted = verdict.hints.max_accepted
        self.width += (self._depth if max_accepted is None else min(max_accepted, self._depth)) + 1
        self._depth = 0
        if self._last is None:
            return
        ngram, shares, unanimous, counts = self._last
        self._last = None
        if counts is not None:  # a chain
            self.acceptance.update(shares, unanimous, ngram, counts, verdict.verify_lengths, verdict.num_accepted)
            return
        trees = verdict.tree
        num_nodes = shares.shape[1]
        path = trees.path_nodes
        on_path = torch.zeros(path.shape[0], num_nodes + 1, dtype=torch.bool, device=path.device)
        on_path = on_path.scatter_(1, torch.where(path >= 0, path, num_nodes), True)[:, :num_nodes]  # (B, N)
        parents = trees.tree.parents
        reached = torch.where(parents >= 0, on_path.gather(1, parents.clamp(min=0)), True)  # (the root always is)
        tried = trees.selected & reached
        context = ngram[:, None] + trees.tree.depths - 1  # (B, N) (depths are 1-based)
        self.acceptance.count(self.acceptance.cells(shares, unanimous, context), tried, tried & on_path)

    def join(self, rows: JoiningRows | None = None, chunk: PromptChunk | None = None) -> None:
        """Rows join unpadded (their first real column is 0); their prompts are read from the rows themselves."""
        if rows is None:
            return
        extra = rows.last_tokens.shape[0]
        self.starts = torch.cat([self.starts, self.starts.new_zeros(extra)])
        self.width = max(self.width, *rows.prompt_lengths)
        if self._last is not None:
            self._last = tuple(None if part is None else torch.cat([part, part.new_zeros(extra, *part.shape[1:])])
                               for part in self._last)

    def settle(self, read: int | None, finished: Retired | None = None, moves: RowMoves | None = None) -> None:
        """Rows that finished join the cache (:meth:`remember`); the others move as ``moves`` says."""
        if finished is not None:
            self.remember(*finished)
        if moves is not None:
            rows = rows_after_fill(*moves)
            self.starts = self.starts[rows]
            if self._last is not None:
                self._last = tuple(None if part is None else part[rows] for part in self._last)

    def remember(self, rows: torch.Tensor, sequences: torch.Tensor, lengths: torch.Tensor) -> None:
        """Rows that finished join the cache: original indices ``rows`` ``(M,)``, tokens ``sequences`` ``(M, T)``
        holding ``lengths`` ``(M,)`` (a call's left padding left out)."""
        known = self.row_starts.shape[0]
        if known == 0:
            starts = torch.zeros_like(lengths)
        else:
            starts = torch.where(rows < known, self.row_starts[rows.clamp(max=known - 1)], 0)
        self.cache.add(sequences, lengths, starts)
