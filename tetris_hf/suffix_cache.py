"""A suffix cache of earlier requests' tokens (:class:`SuffixCache`), the batch searched as one
(:func:`batch_matches`), and the frequency-voted chain or tree a row's recent tokens draft from their occurrences
(:func:`frequency_chain`, :func:`frequency_tree`). Pure tensor code, no device read; the drafter is
:mod:`tetris_hf.candidate_generators.suffix`. Design (layout, memory, matching, scoring): docs/design.md, section
"Suffix drafts".
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable

import torch

from .trees import DraftTree, Expansion, append_nodes, empty_tree

SUFFIX_DEPTH = 8  # the longest n-gram a row's recent tokens are matched by
PEER_BUDGET = 1 << 24  # compared tokens (B * B * W * depth) up to which rows search each other, not just themselves
NO_KEY = torch.iinfo(torch.int64).max  # the key of a column that starts no usable n-gram (sorted last, never asked)
_PRIMES = (2147483647, 2147483629)
_BASES = (1_000_003, 972_663_749)  # multipliers below both primes


def _powers(depth: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(depth,)`` ``base^i mod prime`` for both hashes."""
    return tuple(torch.tensor([pow(base, i, prime) for i in range(depth)], dtype=torch.long, device=device)
                 for prime, base in zip(_PRIMES, _BASES))


def ngram_keys(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """``(depth, *lead, W)``: entry ``[n - 1, ..., p]`` is the key of the ``n`` tokens ending at column ``p`` of
    ``tokens`` ``(*lead, W)`` (``-1``: no token), :data:`NO_KEY` where that window reaches a ``-1`` or the row's
    start (two polynomial hashes: different n-grams collide with probability about ``2^-62``)."""
    power1, power2 = _powers(depth, tokens.device)
    real = tokens >= 0
    values = (tokens + 1).clamp(min=0)
    hash1 = torch.zeros_like(values)
    hash2 = torch.zeros_like(values)
    complete = torch.ones_like(real)
    keys = []
    for n in range(depth):  # the token n places before p joins the window (n >= W: before every column)
        cut = min(n, values.shape[-1])
        shifted = torch.nn.functional.pad(values[..., : values.shape[-1] - cut], (cut, 0), value=0)
        shifted_real = torch.nn.functional.pad(real[..., : real.shape[-1] - cut], (cut, 0), value=False)
        hash1 = (hash1 + shifted * power1[n]) % _PRIMES[0]
        hash2 = (hash2 + shifted * power2[n]) % _PRIMES[1]
        complete = complete & shifted_real
        keys.append(torch.where(complete, hash1 * 2 ** 31 + hash2, NO_KEY))
    return torch.stack(keys)


def suffix_keys(sequences: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, depth: int) -> torch.Tensor:
    """``(depth, B)``: the key of each row's last ``n`` tokens, ``n = 1..depth`` (:data:`NO_KEY` where the row holds
    fewer), for ``sequences`` ``(B, T)`` real in ``[starts[i], lengths[i])`` (``(B,)`` each, ``lengths >= 1``)."""
    columns = (lengths - depth)[:, None] + torch.arange(depth, device=sequences.device)[None, :]  # (B, d)
    window = sequences.gather(1, columns.clamp(min=0))
    window = torch.where(columns >= starts[:, None], window, -1)
    return ngram_keys(window, depth)[:, :, -1]


def longest_match(counts: torch.Tensor) -> torch.Tensor:
    """``(B,)`` the largest ``n`` whose ``counts`` ``(depth, B)`` (occurrences of each row's last ``n`` tokens) is
    positive, 0 where none is."""
    depth = counts.shape[0]
    sizes = torch.arange(1, depth + 1, device=counts.device)[:, None]
    return torch.where(counts > 0, sizes, 0).amax(dim=0)


class SuffixCache:
    """Earlier requests' tokens, indexed by n-gram: a ring of ``max_requests`` (``>= 1``) slots, each the last
    ``tokens_per_request`` (``>= 2``) tokens of a request, right-aligned, keys sorted per ``n = 1..depth``, on
    ``device``. Thread-safe through :attr:`lock`.
    """

    def __init__(self, max_requests: int = 256, tokens_per_request: int = 512, depth: int = SUFFIX_DEPTH,
                 device: torch.device | str = "cpu"):
        for name, value, minimum in (("max_requests", max_requests, 1), ("tokens_per_request", tokens_per_request, 2),
                                     ("depth", depth, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
        self.max_requests, self.width, self.depth = max_requests, tokens_per_request, depth
        device = torch.device(device)
        self.tokens = torch.full((max_requests, tokens_per_request), -1, dtype=torch.long, device=device)  # (R, W)
        # slot-major, so the written slots 0..R'-1 are one contiguous block to search
        self.keys = torch.full((max_requests, depth, tokens_per_request), NO_KEY, dtype=torch.long,
                               device=device)  # (R, d, W) sorted along W
        self.columns = torch.zeros((max_requests, depth, tokens_per_request), dtype=torch.int32,
                                   device=device)  # (R, d, W) the column each sorted key ends at
        self.next_slot = 0  # the slot the next request takes
        self.added = 0  # requests added over the cache's life
        self.lock = threading.RLock()

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def num_requests(self) -> int:
        """Requests held now (at most ``max_requests``)."""
        return min(self.added, self.max_requests)

    @property
    def nbytes(self) -> int:
        """Bytes the cache's tensors hold (fixed at construction)."""
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.keys, self.columns))

    def to(self, device: torch.device | str) -> SuffixCache:
        """Move the tensors to ``device`` (in place; returns ``self``)."""
        with self.lock:
            self.tokens, self.keys, self.columns = (t.to(device) for t in (self.tokens, self.keys, self.columns))
        return self

    def add(self, sequences: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor | None = None) -> None:
        """Keep requests: row ``i`` of ``sequences`` ``(M, T)`` holds real tokens in ``[starts[i], lengths[i])``
        (``(M,)`` each, ``starts`` default 0); each takes the next slot. Reads nothing from the device."""
        num = sequences.shape[0]
        if num == 0:
            return
        if num > self.max_requests:  # only the last ones would survive
            sequences, lengths = sequences[-self.max_requests:], lengths[-self.max_requests:]
            starts = None if starts is None else starts[-self.max_requests:]
            num = self.max_requests
        device = self.device
        sequences, lengths = sequences.to(device), lengths.to(device)
        starts = torch.zeros_like(lengths) if starts is None else starts.to(device)
        columns = (lengths - self.width)[:, None] + torch.arange(self.width, device=device)[None, :]  # (M, W)
        tokens = sequences.gather(1, columns.clamp(min=0, max=sequences.shape[1] - 1))
        tokens = torch.where((columns >= starts[:, None]) & (columns >= 0), tokens, -1)
        keys = ngram_keys(tokens, self.depth)  # (d, M, W)
        # an n-gram counts only where a token follows it (right-aligned: every column but the last)
        keys[:, :, -1] = NO_KEY
        keys, order = keys.sort(dim=-1)
        with self.lock:
            slots = (self.next_slot + torch.arange(num, device=device)) % self.max_requests
            self.tokens[slots] = tokens
            self.keys[slots] = keys.transpose(0, 1)
            self.columns[slots] = order.to(torch.int32).transpose(0, 1)
            self.next_slot = (self.next_slot + num) % self.max_requests
            self.added += num

    def add_token_lists(self, requests: list[list[int]]) -> None:
        """Keep requests given as token lists (e.g. earlier outputs read from a file)."""
        requests = [list(request) for request in requests if len(request) > 0]
        if not requests:
            return
        width = max(len(request) for request in requests)
        sequences = torch.full((len(requests), width), -1, dtype=torch.long)
        for row, request in enumerate(requests):
            sequences[row, : len(request)] = torch.tensor(request, dtype=torch.long)
        self.add(sequences, torch.tensor([len(request) for request in requests]))

    @classmethod
    def from_file(cls, path: str | os.PathLike, vocab_size: int | None = None, **sizes) -> SuffixCache:
        """A cache seeded from a file of earlier requests (:meth:`add_file`); ``sizes``: the constructor's
        (``max_requests``, ``tokens_per_request``, ``depth``, ``device``)."""
        cache = cls(**sizes)
        cache.add_file(path, vocab_size)
        return cache

    def add_file(self, path: str | os.PathLike, vocab_size: int | None = None) -> int:
        """Keep the requests of a seed file, oldest first; returns how many. JSON lines, each a JSON array of token ids
        (integers ``>= 0``, below ``vocab_size`` when given), e.g. ``[1, 15043, 29892]``; blank lines and empty arrays
        are skipped. Anything else raises ``ValueError`` naming the file and line, before anything is added.
        """
        requests = read_token_lists(path, vocab_size)
        self.add_token_lists(requests)
        return len(requests)

    def save(self, path: str | os.PathLike) -> int:
        """Write the requests held, oldest first, as a seed file :meth:`add_file` reads back; returns how many. Reads
        the device (not for a step)."""
        with self.lock:
            held = self.num_requests
            first = self.next_slot if self.added >= self.max_requests else 0
            order = [(first + index) % self.max_requests for index in range(held)]
            rows = self.tokens[order].tolist() if order else []
        with open(path, "w", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps([token for token in row if token >= 0]) + "\n")
        return len(rows)

    @property
    def searched(self) -> int:
        """Slots a query searches, ``R'``: the ones written so far (at least one); a host number."""
        return max(1, self.num_requests)

    def ranges(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each key of ``query`` ``(d, B)`` (:func:`suffix_keys`) sits in every written slot's sorted keys:
        ``lo``, ``hi`` ``(d, R', B)`` (row ``b``'s last ``n`` tokens occur in slot ``r`` at
        ``keys[r, n - 1, lo:hi]``)."""
        depth, rows = query.shape
        keys = self.keys[: self.searched]  # (R', d, W), contiguous
        values = query[None].expand(keys.shape[0], depth, rows).contiguous()  # (R', d, B)
        lo = torch.searchsorted(keys, values, side="left").transpose(0, 1)  # (d, R', B)
        hi = torch.searchsorted(keys, values, side="right").transpose(0, 1)
        hi = torch.where(query[:, None, :] == NO_KEY, lo, hi)
        return lo, hi

    def continuations(self, lo: torch.Tensor, hi: torch.Tensor, ngram: torch.Tensor, num: int,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``num`` occurrences per row of its last ``ngram[b]`` tokens (``(B,)``, 0: none), newest slots
        first (``lo``, ``hi`` ``(d, R', B)`` from :meth:`ranges`): ``tokens`` ``(B, num, K)``, the ``K = num_tokens``
        after each (``-1`` past a request's end), and ``found`` ``(B, num)`` bool."""
        rows = ngram.shape[0]
        device = self.device
        searched = lo.shape[1]  # R': every slot once the ring is full, else slots 0..R'-1 (next_slot == R')
        size = (ngram - 1).clamp(min=0)  # (B,)
        count = (hi - lo).gather(0, size[None, None, :].expand(1, searched, rows))[0].T  # (B, R') by slot
        count = torch.where(ngram[:, None] > 0, count, 0)
        newest = (self.next_slot - 1 - torch.arange(searched, device=device)) % searched  # (R',)
        count = count[:, newest]  # (B, R') newest slot first
        ends = count.cumsum(dim=1)  # (B, R')
        wanted = torch.arange(num, device=device).expand(rows, num).contiguous()  # (B, num)
        rank = torch.searchsorted(ends, wanted, side="right").clamp(max=searched - 1)  # (B, num)
        found = wanted < ends[:, -1:]
        offset = wanted - (ends.gather(1, rank) - count.gather(1, rank))
        slot = newest[rank]  # (B, num)
        first = lo[size[:, None], slot, torch.arange(rows, device=device)[:, None]]  # (B, num)
        place = (first + offset).clamp(max=self.width - 1)
        column = self.columns[slot, size[:, None], place].long()  # (B, num) where the n-gram ends
        after = column[..., None] + 1 + torch.arange(num_tokens, device=device)  # (B, num, K)
        tokens = self.tokens[slot[..., None], after.clamp(max=self.width - 1)]
        tokens = torch.where((after < self.width) & found[..., None], tokens, -1)
        return tokens, found


def read_token_lists(path: str | os.PathLike, vocab_size: int | None = None) -> list[list[int]]:
    """The requests of a seed file (:meth:`SuffixCache.add_file`) as token-id lists; ``ValueError`` naming the file
    and line of the first bad one."""
    requests, hint = [], "a seed file holds one JSON array of token ids a line, e.g. [1, 15043, 29892]"
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                tokens = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{os.fspath(path)}:{number}: not JSON ({error.msg}); {hint}") from None
            if not isinstance(tokens, list):
                bad = f"a JSON {type(tokens).__name__}, not an array of token ids"
            else:
                bad = next((f"token {token!r} at position {place} is not an integer >= 0"
                            for place, token in enumerate(tokens)
                            if isinstance(token, bool) or not isinstance(token, int) or token < 0), None)
                if bad is None and vocab_size is not None:
                    bad = next((f"token {token} at position {place} is not below the vocabulary size {vocab_size}"
                                for place, token in enumerate(tokens) if token >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{os.fspath(path)}:{number}: {bad}; {hint}")
            requests.append(tokens)
    return requests


def frequency_chain(candidates: torch.Tensor, alive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor, torch.Tensor]:
    """The most frequent continuation, depth by depth, among the ``(B, C, K)`` ``candidates`` (the ``K`` tokens after
    each of ``C`` occurrences, ``-1`` past its end) that are ``alive`` ``(B, C)``; ties go to the earliest.

    Returns:
        ``tokens`` ``(B, K)`` (0 past a row's count), ``counts`` ``(B,)`` cells drafted, ``chosen`` ``(B, K)``
        occurrences that had the drafted token at each depth and ``total`` ``(B, K)`` occurrences alive there.
    """
    rows, _, num_tokens = candidates.shape
    tokens, chosen, total = [], [], []
    for depth in range(num_tokens):
        column = candidates[:, :, depth]  # (B, C)
        alive = alive & (column >= 0)
        same = (column[:, :, None] == column[:, None, :]) & alive[:, None, :]  # (B, C, C)
        votes = torch.where(alive, same.sum(dim=2), -1)  # (B, C)
        best = votes.argmax(dim=1, keepdim=True)  # (B, 1) the first occurrence of the most frequent token
        token = column.gather(1, best)  # (B, 1)
        count = votes.gather(1, best)[:, 0].clamp(min=0)
        tokens.append(torch.where(count > 0, token[:, 0], 0))
        chosen.append(count)
        total.append(alive.sum(dim=1))
        alive = alive & (column == token)
    chosen, total = torch.stack(chosen, dim=1), torch.stack(total, dim=1)
    return torch.stack(tokens, dim=1), (chosen > 0).sum(dim=1), chosen, total


def frequency_tree(candidates: torch.Tensor, alive: torch.Tensor, width: int,
                   log_conditional: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
                   ) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
    """The distinct continuations among each row's occurrences as a draft tree of ``K`` levels and ``width`` nodes a
    level (``N = width * K``): each level the ``width`` most voted next tokens of each of the previous level's nodes,
    the ``width`` best of those by path score kept. A node's share is ``count / (total + 1)``, its score its parent's
    plus ``log_conditional(share, unanimous, level)`` (``unanimous``: every occurrence at the parent has the node's
    token; ``level``: 0 for the first);
    ties go to the earliest occurrence, so ``width = 1`` gives :func:`frequency_chain`'s chain.

    E.g. continuations ``[a b]``, ``[a b]``, ``[a c]``, ``[d e]``, ``width = 2``: level 1 ``a`` (3 of 4), ``d`` (1 of
    4); level 2 the best two of ``a``'s ``b`` (2 of 3), ``c`` (1 of 3) and ``d``'s ``e`` (1 of 1).

    Args:
        candidates, alive: as for :func:`frequency_chain`.
        width: nodes a level (children per expanded node), ``>= 1``.
        log_conditional: ``(B, M)`` vote shares, ``(B, M)`` bool unanimity and the level (an int) -> ``(B, M)`` log
            conditional acceptance (``<= 0``).

    Returns:
        The :class:`~tetris_hf.trees.DraftTree` (an invalid node scores ``-inf``), ``shares`` ``(B, N)`` each
        node's vote share (0 where invalid) and ``unanimous`` ``(B, N)`` (False where invalid).
    """
    rows, num, depth = candidates.shape
    device = candidates.device
    occurrence = torch.arange(num, device=device)
    earlier = occurrence[None, :] < occurrence[:, None]  # (C, C): [c, c'] c' comes before c
    owner = torch.where(alive, 0, -1)  # (B, C) the frontier node each occurrence agrees with (the root: 0), -1: none
    frontier_scores = torch.zeros(rows, 1, device=device)
    tree, shares = empty_tree(rows, device), [torch.zeros(rows, 0, device=device)]
    unanimous = [torch.zeros(rows, 0, dtype=torch.bool, device=device)]
    for level in range(depth):
        frontier = frontier_scores.shape[1]
        token = candidates[:, :, level]  # (B, C)
        owner = torch.where(token >= 0, owner, -1)  # an occurrence that ended drops out
        same = (owner[:, :, None] == owner[:, None, :]) & (token[:, :, None] == token[:, None, :])  # (B, C, C)
        same &= owner[:, None, :] >= 0
        votes = same.sum(dim=2)  # (B, C) occurrences that agree with c's path and next token
        first = (owner >= 0) & ~(same & earlier).any(dim=2)  # one occurrence stands for each (node, token)
        key = torch.where(first, votes * num + (num - 1 - occurrence), -1)  # most votes, then the earliest
        mine = owner[:, None, :] == torch.arange(frontier, device=device)[None, :, None]  # (B, F, C)
        top_key, top = _best_children(mine, key, width)
        valid = (top_key >= 0) & (frontier_scores[..., None] > float("-inf"))  # (B, F, w)
        flat = top.flatten(1)  # (B, F w)
        child_tokens = torch.where(valid, token.gather(1, flat).view(rows, frontier, width), 0)  # (0: no node)
        child_votes, parent_votes = votes.gather(1, flat).view(rows, frontier, width), mine.sum(dim=2)[..., None]
        share = torch.where(valid, child_votes / (parent_votes + 1), 0.0)
        agree = valid & (child_votes == parent_votes)
        scores = frontier_scores[..., None] + log_conditional(share.flatten(1), agree.flatten(1), level).view(
            rows, frontier, width)
        scores = scores.masked_fill(~valid, float("-inf"))
        # the best `width` of the F * w candidates, ties in candidate order (parent, then rank)
        order = torch.sort(scores.flatten(1), dim=1, descending=True, stable=True).indices[:, :width]  # (B, w)
        kept = Expansion(torch.div(order, width, rounding_mode="floor"), child_tokens.flatten(1).gather(1, order),
                         scores.flatten(1).gather(1, order), valid.flatten(1).gather(1, order))
        tree = append_nodes(tree, kept, -1 if level == 0 else (level - 1) * width)
        shares.append(share.flatten(1).gather(1, order))
        unanimous.append(agree.flatten(1).gather(1, order))
        owner, frontier_scores = _follow(kept, owner, token), kept.log_scores
    return tree, torch.cat(shares, dim=1), torch.cat(unanimous, dim=1)


def _best_children(mine: torch.Tensor, key: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each frontier node, the ``width`` best of its occurrences by ``key`` ``(B, C)`` (``mine`` ``(B, F, C)``:
    which are the node's): ``(B, F, width)`` keys (``-1``: none) and occurrence indices."""
    num = key.shape[1]
    top_key, top = torch.where(mine, key[:, None, :], -1).topk(min(width, num), dim=2)  # (B, F, w')
    if top.shape[2] < width:
        pad = width - top.shape[2]
        top_key = torch.nn.functional.pad(top_key, (0, pad), value=-1)
        top = torch.nn.functional.pad(top, (0, pad))
    return top_key, top


def _follow(kept: Expansion, owner: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``(B, C)`` the kept node each occurrence now agrees with: the kept child of its node ``owner`` with its
    ``token`` (``-1``: none was kept)."""
    follows = (kept.parents[:, None, :] == owner[:, :, None]) & (kept.tokens[:, None, :] == token[:, :, None])
    follows &= kept.valid[:, None, :]  # (B, C, w)
    return torch.where(follows.any(dim=2), follows.long().argmax(dim=2), -1)


def batch_matches(sequences: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, depth: int,
                  peers: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """How far every column of every row of a batch matches each row's last tokens (a row's own earlier tokens, and
    every other row's).

    E.g. rows ``[a b c a b]`` and ``[x a b d]`` (no padding), ``depth = 3``: row 0's last tokens ``a b`` end at row 0
    column 1 (2 tokens, followed by ``c``) and row 1 column 2 (2 tokens, followed by ``d``).

    Args:
        sequences: ``(B, W)``; row ``i`` real in ``[starts[i], lengths[i])`` (``(B,)`` each).
        depth: the most tokens compared.
        peers: search every row (``B * B * W * depth`` compares); ``False``: each row only itself.

    Returns:
        ``context`` ``(B, B * W)`` ``uint8`` (``(B, W)`` without ``peers``): for query row ``b`` and column ``p`` of
        row ``r`` (``r * W + p``), how many tokens ending there equal row ``b``'s last ones, 0 where no token follows;
        and ``tokens`` ``(B, W)``, the rows' real tokens, ``-1`` elsewhere.
    """
    rows, width = sequences.shape
    device = sequences.device
    columns = torch.arange(width, device=device)[None, :]
    real = (columns >= starts[:, None]) & (columns < lengths[:, None])
    tokens = torch.where(real, sequences, -1)  # (B, W)
    last = (lengths - 1).clamp(min=0)[:, None]  # (B, 1)
    # depth by depth, from the last token back: a column still matches after j + 1 tokens iff it matched after j
    # and the token j places before it equals row b's token j places before its end
    padded = torch.nn.functional.pad(tokens, (depth, 0), value=-1)  # (B, d + W): column p is p + d
    context = None
    alive = None
    for back in range(depth):
        haystack = padded[:, depth - back: depth - back + width]  # (B, W): the token ``back`` places before p
        wanted = tokens.gather(1, (last - back).clamp(min=0))  # (B, 1) row b's token ``back`` before its end
        wanted = torch.where((last - back >= 0) & (wanted >= 0), wanted, -2)  # a row's own padding matches nothing
        same = (haystack.reshape(1, -1) == wanted) if peers else (haystack == wanted)  # (B, B W) or (B, W)
        alive = same if alive is None else alive.logical_and_(same)
        context = alive.to(torch.uint8) if context is None else context.add_(alive)
    followed = (columns + 1 < lengths[:, None]) & real  # (B, W) a token follows in the same row
    context = context.masked_fill_(~(followed.reshape(1, -1) if peers else followed), 0)
    return context, tokens


def own_match_lengths(context: torch.Tensor, width: int) -> torch.Tensor:
    """``(B,)`` the longest match of each row's last tokens among its own earlier tokens, from :func:`batch_matches`'
    ``context`` over rows of ``width`` columns (with or without peers)."""
    rows, flat = context.shape
    if flat != width:  # peers: (B, B W), row b's own columns in block b
        context = context.view(rows, rows, width).diagonal(dim1=0, dim2=1)  # (W, B)
        return context.amax(dim=0).long()
    return context.amax(dim=1).long()


def batch_continuations(tokens: torch.Tensor, context: torch.Tensor, ngram: torch.Tensor, num: int,
                        num_tokens: int, own_only: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num`` of each row's occurrences in the batch that match at least ``ngram[b]`` tokens (``(B,)``, 0:
    none), the longest matches first, then the row's own, then the latest (``tokens`` ``(B, W)`` and ``context``
    from :func:`batch_matches`); rows where ``own_only`` ``(B,)`` is set take their own occurrences alone:
    ``candidates`` ``(B, num, K)``, the ``K`` tokens after each (``-1`` past a row's end), and ``found`` ``(B, num)``
    bool."""
    rows, width = tokens.shape
    flat = context.shape[1]
    device = tokens.device
    # rank by (match length, the row's own, place) packed in one int32: length * 2 flat + own * flat + place
    key = context.int() * (2 * flat) + torch.arange(flat, dtype=torch.int32, device=device)[None, :]  # (B, B W)
    if flat != width:
        row_base = 0  # peers: the place says which row
        key.view(rows, rows, width).diagonal(dim1=0, dim2=1).add_(flat)  # row b's own columns in row b's query
    else:
        row_base = torch.arange(rows, device=device)[:, None] * width  # each row itself
        key.add_(flat)
    drop = (context < ngram[:, None]) | (ngram[:, None] <= 0)
    if own_only is not None and flat != width:  # (without peers every occurrence is the row's own)
        peer = torch.arange(flat, device=device)[None, :] // width != torch.arange(rows, device=device)[:, None]
        drop |= own_only[:, None] & peer
    key = key.masked_fill_(drop, -1)
    num = min(num, flat)
    key, chosen = key.topk(num, dim=1)  # (B, num)
    chosen = chosen + row_base
    found = key >= 0
    row_of, column = chosen // width, chosen % width
    after = column[..., None] + 1 + torch.arange(num_tokens, device=device)  # (B, num, K)
    candidates = tokens[row_of[..., None], after.clamp(max=width - 1)]
    candidates = torch.where((after < width) & found[..., None], candidates, -1)
    return candidates, found
