"""Prompt-lookup drafts for every row of a batch: no draft model, the row's own tokens are the draft.

Each step, row ``i`` looks for its last ``n`` tokens earlier in its own prompt and output, for ``n`` up to the
longest allowed n-gram; the longest ``n`` that matches wins. Among that n-gram's occurrences it copies from the one
(:func:`lookup_drafts`, ``occurrence="best"``):

1. with the most tokens after it to copy, up to ``K`` (the output's own recent copy of a passage is cut short by the
   row's end, while the passage it copies goes on);
2. then whose match with the row's end is longest, up to ``CONTEXT_TOKENS`` tokens (the passage the row is working
   through agrees with it beyond the n-gram);
3. then the latest (a long generation that repeats itself repeats what it wrote last).

Replayed on the target's own greedy outputs (``examples/lookup_occurrence.py``, ``docs/lookup-occurrence.txt``) this
beats both the latest occurrence alone and the earliest (transformers' one-row rule) on code edits, summaries and
chat. The row drafts the tokens that followed that occurrence, up to ``K``, never past its own end. A row without a
match drafts nothing that step. Left padding is never matched.

Every drafted cell gets a confidence TETRIS can rank across rows: the estimated probability that the target accepts
it given that the cells before it were accepted, by the n-gram length ``n`` that matched and the cell's position
``j``, learnt during the call from what the target accepted (:class:`LookupAcceptance`). A lookup draft is
deterministic given the row, so when sampling its ``q`` is one-hot at the drafted token: a cell is accepted with
probability ``p(x)`` and a rejection samples ``p`` without ``x``.

Everything runs batched on the device (no loop over rows, no device reads).
"""

from __future__ import annotations

import torch

from ..kv import rows_after_fill
from ..options import DEFAULT_MAX_NGRAM_SIZE
from .calibration import OnlineRates
from .drafter import Drafter, JoiningRows, PromptChunk, Proposal, Retired, RowMoves, Verdict, check_chains

CONTEXT_TOKENS = 16  # how far back an occurrence's match with the row's end is compared
OCCURRENCES = ("best", "latest", "earliest")


def context_matches(haystack: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, depth: int) -> torch.Tensor:
    """``(B, W)``: for every column ``p``, how many tokens ending at ``p`` equal the row's last tokens, at most
    ``depth`` (left padding matches nothing).

    E.g. a row ``[a b c d b c]``, ``depth = 4``: ``[0 0 2 0 0 4]``; column 2 (``a b c``) matches ``b c``, column 5
    is the row's end itself.

    Args:
        haystack: ``(B, W)`` tokens; row ``i`` holds real tokens in ``[starts[i], lengths[i])``, ``lengths <= W``.
        starts, lengths: ``(B,)``.
        depth: the most tokens compared.
    """
    columns = torch.arange(haystack.shape[1], device=haystack.device)
    real = torch.where(columns[None, :] >= starts[:, None], haystack, -1)  # padding: -1, matches no suffix token
    windows = torch.nn.functional.pad(real, (depth - 1, 0), value=-1).unfold(1, depth, 1)  # (B, W, d) ending at p
    suffix = windows.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, depth))  # (B, 1, d) ending at the row's end
    suffix = suffix.masked_fill(suffix < 0, -2)  # the row's own padding matches nothing either
    # 1 + the place of each window's last differing token (0: none differs); the matched tokens are those after it
    places = torch.arange(1, depth + 1, dtype=torch.int16, device=haystack.device)
    last_difference = ((windows != suffix) * places).amax(dim=-1)  # (B, W)
    return depth - last_difference.long()


def lookup_drafts(sequences: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, num_tokens: int,
                  ngram_sizes: range, width: int | None = None,
                  occurrence: str = "best") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched prompt lookup: for every row, the tokens after an earlier occurrence of its longest matching suffix
    n-gram.

    E.g. a row ``[a b c d b c]`` (no padding), sizes 2..1, ``K = 3``: its last 2-gram ``b c`` occurs at 1, followed
    by ``d b c``, but only up to the row's end: drafts ``[d b c]``, 3 cells, ``n = 2``.

    Args:
        sequences: ``(B, T)`` tokens; row ``i`` holds real tokens in ``[starts[i], lengths[i])``.
        starts: ``(B,)`` first real column of each row (left padding before it is never matched).
        lengths: ``(B,)``.
        num_tokens: ``K``.
        ngram_sizes: n-gram sizes to try, e.g. ``range(1, 4)``; the largest that matches wins.
        width: a host bound on ``lengths.max()`` (columns past it are not searched), default ``T``.
        occurrence: which occurrence of that n-gram: ``"best"`` (the most tokens to copy, up to ``K``, then the
            longest match with the row's end, then the latest: see the module's docstring), ``"latest"``, or
            ``"earliest"`` (transformers' one-row lookup); the last two are kept to measure the choice
            (``examples/lookup_occurrence.py``).

    Returns:
        drafts ``(B, K)`` (filler past each row's count: its last real token), counts ``(B,)`` drafted cells,
        ``ngram`` ``(B,)`` the n-gram size that matched (0: no match, nothing drafted).
    """
    if occurrence not in OCCURRENCES:
        raise ValueError(f"occurrence must be one of {OCCURRENCES}, got {occurrence!r}")
    total = sequences.shape[1]
    width = total if width is None else min(width, total)
    haystack = sequences[:, :width]
    ends = torch.arange(width, device=sequences.device)[None, :]  # (1, W) where an occurrence ends
    depth = max(max(ngram_sizes), CONTEXT_TOKENS if occurrence == "best" else 0)
    context = context_matches(haystack, starts, lengths, depth)  # (B, W)
    ngram = context.clamp(max=max(ngram_sizes))  # the longest n-gram each occurrence matches
    # an earlier occurrence followed by at least one token (which excludes the row's end itself)
    valid = (ngram >= min(ngram_sizes)) & (ends + 1 < lengths[:, None])
    room = (lengths[:, None] - 1 - ends).clamp(min=0, max=num_tokens)  # tokens after it to copy, at most K
    # the longest n-gram first, then the rule's order, packed into one integer key per occurrence
    if occurrence == "best":
        key = ((ngram * (num_tokens + 1) + room) * (depth + 1) + context) * width + ends
    elif occurrence == "latest":
        key = ngram * width + ends
    else:
        key = ngram * width + (width - 1 - ends)
    key = torch.where(valid, key, -1)
    chosen = key.argmax(dim=1, keepdim=True)  # (B, 1)
    ngram = torch.where(key.gather(1, chosen) >= 0, ngram.gather(1, chosen), 0)[:, 0]
    first = chosen[:, 0] + 1  # where the copied tokens start
    counts = torch.where(ngram > 0, (lengths - first).clamp(max=num_tokens), 0)
    positions = first[:, None] + torch.arange(num_tokens, device=sequences.device)[None, :]
    positions = torch.minimum(positions, (lengths - 1)[:, None]).clamp(min=0)  # filler: a real token, never verified
    return sequences.gather(1, positions), counts, ngram


class LookupAcceptance(OnlineRates):
    """Online estimate of how often a lookup cell is accepted, by matched n-gram size and cell position.

    Cell ``j`` of a row that matched an ``n``-gram is accepted, given that cells ``1..j-1`` were, with probability
    ``a[n, j]``, an :class:`~.calibration.OnlineRates` table around ``prior[j] = prior_first * prior_decay^j`` (later
    cells copy further from the match and drift more often), updated by every verified cell the target reached;
    counts decay by ``memory`` per step.

    Args:
        max_ngram_size: largest n-gram size (rows are indexed by ``n``; 0 is unused).
        num_cells: ``K``, cells per row.
        device: where the counts live.
    """

    def __init__(self, max_ngram_size: int, num_cells: int, device: torch.device, prior_first: float = 0.5,
                 prior_decay: float = 0.9, prior_strength: float = 4.0, memory: float = 0.99):
        prior = prior_first * prior_decay ** torch.arange(num_cells, dtype=torch.float32, device=device)
        super().__init__(prior.expand(max_ngram_size + 1, num_cells), prior_strength, memory)
        self.num_cells = num_cells

    def log_probs(self, ngram: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``(B, K)`` log acceptance of each cell of rows that matched ``ngram`` ``(B,)`` (``-inf`` where nothing
        matched)."""
        scores = self.rates()[ngram, :num_tokens].log()
        return scores.masked_fill((ngram == 0)[:, None], float("-inf"))

    def update(self, ngram: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Count one step: rows matched ``ngram`` ``(B,)``, verified ``verify_lengths`` and accepted ``num_accepted``
        cells (the target reached cells ``0..num_accepted``, those below ``verify_lengths``)."""
        cells = torch.arange(self.num_cells, device=ngram.device)[None, :]
        tried = (cells < verify_lengths[:, None]) & (cells <= num_accepted[:, None])
        self.count(ngram[:, None] * self.num_cells + cells, tried, tried & (cells < num_accepted[:, None]))


class BatchedPromptLookupCandidateGenerator(Drafter):
    """Prompt-lookup drafting for a batch whose rows advance independently: the batched counterpart of transformers'
    ``PromptLookupCandidateGenerator`` (which serves one row), driven through :class:`~.drafter.Drafter`.

    Args:
        max_ngram_size: ``max_matching_ngram_size``, the longest suffix n-gram looked up.
        min_ngram_size: the shortest (1: a single token may match).
        max_tokens: the most cells any proposal drafts (sizes the acceptance table).
    """

    def __init__(self, max_ngram_size: int = DEFAULT_MAX_NGRAM_SIZE, min_ngram_size: int = 1, max_tokens: int = 8):
        self.ngram_sizes = range(min_ngram_size, max_ngram_size + 1)
        self.max_tokens = max_tokens
        self.starts: torch.Tensor | None = None  # (B,) first real column of each row
        self.width = 0  # a host bound on the rows' lengths
        self.acceptance: LookupAcceptance | None = None
        self._ngram: torch.Tensor | None = None  # (B,) what each row matched at the last proposal
        self._last_num_drafted = 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        batch, length = input_ids.shape
        self.starts = length - attention_mask.long().sum(dim=1)  # left-padded: padding comes first
        self.width = length
        self.acceptance = LookupAcceptance(max(self.ngram_sizes), self.max_tokens, input_ids.device)

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int,
                rows: torch.Tensor | None = None, confidences: bool = True, *, lookup_only: bool = False,
                tree_width: int = 1) -> Proposal:
        check_chains(self, tree_width)
        self._last_num_drafted = num_tokens
        if num_tokens == 0:
            empty = sequences.new_zeros(sequences.shape[0], 0)
            self._ngram = None
            return Proposal(empty, empty.float() if confidences else None, None, None)
        if num_tokens > self.max_tokens:
            raise ValueError(f"asked for {num_tokens} lookup cells, the table holds {self.max_tokens}")
        drafts, counts, ngram = lookup_drafts(sequences, self.starts, lengths, num_tokens, self.ngram_sizes,
                                              self.width)
        sequences.scatter_(1, lengths[:, None] + torch.arange(num_tokens, device=lengths.device), drafts)
        self._ngram = ngram
        log_probs = self.acceptance.log_probs(ngram, num_tokens) if confidences else None
        return Proposal(drafts, log_probs, None, counts, torch.ones_like(counts, dtype=torch.bool))

    def accept(self, verdict: Verdict) -> None:
        drafted = self._last_num_drafted
        max_accepted = verdict.hints.max_accepted
        self.width += (drafted if max_accepted is None else min(max_accepted, drafted)) + 1
        if drafted > 0:
            self.acceptance.update(self._ngram, verdict.verify_lengths, verdict.num_accepted)

    def settle(self, read: int | None, finished: Retired | None = None, moves: RowMoves | None = None) -> None:
        if moves is not None:
            rows = rows_after_fill(*moves)
            self.starts = self.starts[rows]
            if self._ngram is not None:
                self._ngram = self._ngram[rows]

    def join(self, rows: JoiningRows | None = None, chunk: PromptChunk | None = None) -> None:
        """Rows join unpadded (their first real column is 0); the acceptance table is shared with them. Lookup reads
        their prompts from the rows themselves (``chunk`` is nothing to it)."""
        if rows is None:
            return
        count = rows.last_tokens.shape[0]
        self.starts = torch.cat([self.starts, self.starts.new_zeros(count)])
        self.width = max(self.width, *rows.prompt_lengths)
        if self._ngram is not None:
            self._ngram = torch.cat([self._ngram, self._ngram.new_zeros(count)])
