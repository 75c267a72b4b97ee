"""Prompt-lookup drafts for every row of a batch (:class:`BatchedPromptLookupCandidateGenerator`,
:func:`lookup_drafts`): the tokens after an earlier occurrence of the row's longest matching suffix n-gram, batched on
the device with no device read, each cell ranked by :class:`LookupAcceptance`. Which occurrence, and why:
docs/design.md, section "The drafter protocol".
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
    """``(B, W)``: for every column ``p`` of ``haystack`` ``(B, W)`` (row ``i`` real in ``[starts[i], lengths[i])``,
    ``(B,)`` each), how many tokens ending at ``p`` equal the row's last tokens, at most ``depth``.

    E.g. a row ``[a b c d b c]``, ``depth = 4``: ``[0 0 2 0 0 4]`` (column 5 is the row's end itself).
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
    n-gram (e.g. a row ``[a b c d b c]``, sizes 2..1, ``K = 3``: ``b c`` occurs at 1, drafts ``[d b c]``, ``n = 2``).

    Args:
        sequences: ``(B, T)`` tokens; row ``i`` real in ``[starts[i], lengths[i])`` (``(B,)`` each).
        num_tokens: ``K``.
        ngram_sizes: n-gram sizes to try, e.g. ``range(1, 4)``; the largest that matches wins.
        width: a host bound on ``lengths.max()``, default ``T``.
        occurrence: ``"best"`` (the most tokens to copy, up to ``K``, then the longest match with the row's end,
            then the latest), ``"latest"``, or ``"earliest"`` (transformers' one-row rule; both kept to measure).

    Returns:
        drafts ``(B, K)`` (past a row's count: its last real token), counts ``(B,)``, ``ngram`` ``(B,)`` (0: none).
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
    """Online estimate of how often a lookup cell is accepted given the cells before it were, by matched n-gram size
    ``n <= max_ngram_size`` and cell position ``j < num_cells``: an :class:`~.calibration.OnlineRates` table around
    ``prior_first * prior_decay^j``."""

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
    """Prompt-lookup drafting for a batch (the batched ``PromptLookupCandidateGenerator``): n-grams of
    ``min_ngram_size..max_ngram_size`` tokens, at most ``max_tokens`` cells a proposal."""

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
        """Rows join unpadded (their first real column is 0); lookup reads their prompts from the rows themselves."""
        if rows is None:
            return
        count = rows.last_tokens.shape[0]
        self.starts = torch.cat([self.starts, self.starts.new_zeros(count)])
        self.width = max(self.width, *rows.prompt_lengths)
        if self._ngram is not None:
            self._ngram = torch.cat([self._ngram, self._ngram.new_zeros(count)])
