"""The suffix cache and its matcher (tetris_hf/suffix_cache.py), against row-by-row references: the longest match and
every occurrence's continuation are found, the drafted chain is always a continuation seen after the row's last
tokens, the vote counts add up, and eviction keeps the cap."""

import collections
import json
import math
import re
import threading

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tetris_hf.candidate_generators.suffix import SuffixCandidateGenerator
from tetris_hf.suffix_cache import (SuffixCache, batch_continuations, batch_matches, frequency_chain, frequency_tree,
                                    longest_match, own_match_lengths, suffix_keys)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
requests_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6)
row_strategy = st.lists(st.integers(0, 3), min_size=1, max_size=8)


def occurrences_in(requests: list[list[int]], suffix: list[int], num_tokens: int) -> list[list[int]]:
    """The reference: the ``num_tokens`` tokens after every occurrence of ``suffix`` followed by a token."""
    found = []
    size = len(suffix)
    for request in requests:
        for end in range(size - 1, len(request) - 1):
            if request[end - size + 1 : end + 1] == suffix:
                found.append(request[end + 1 : end + 1 + num_tokens])
    return found


def longest_in(requests: list[list[int]], row: list[int], depth: int) -> int:
    return max([n for n in range(1, min(depth, len(row)) + 1) if occurrences_in(requests, row[-n:], 1)], default=0)


def cache_of(requests: list[list[int]], depth: int = 3, max_requests: int = 8, width: int = 16) -> SuffixCache:
    cache = SuffixCache(max_requests=max_requests, tokens_per_request=width, depth=depth)
    cache.add_token_lists(requests)
    return cache


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as a left-padded batch ``(B, T)`` and its mask, the padding 0 (which real tokens use too)."""
    width = max(len(row) for row in rows)
    prompts = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        prompts[index, width - len(row):] = torch.tensor(row)
        mask[index, width - len(row):] = 1
    return prompts, mask


def query(cache: SuffixCache, row: list[int], num: int, num_tokens: int):
    keys = suffix_keys(torch.tensor([row]), torch.tensor([0]), torch.tensor([len(row)]), cache.depth)
    lo, hi = cache.ranges(keys)
    ngram = longest_match((hi - lo).sum(dim=1))
    tokens, found = cache.continuations(lo, hi, ngram, num, num_tokens)
    return int(ngram[0]), [[t for t in cand if t >= 0] for cand in tokens[0][found[0]].tolist()]


@SETTINGS
@given(requests_strategy, row_strategy)
def test_cache_finds_the_longest_match_and_every_continuation(requests, row):
    cache = cache_of(requests)
    ngram, continuations = query(cache, row, num=64, num_tokens=3)
    assert ngram == longest_in(requests, row, 3)
    expected = occurrences_in(requests, row[-ngram:], 3) if ngram else []
    assert collections.Counter(map(tuple, continuations)) == collections.Counter(map(tuple, expected))


@SETTINGS
@given(requests_strategy, row_strategy, st.integers(1, 4))
def test_a_capped_query_returns_occurrences_of_the_newest_requests_first(requests, row, num):
    cache = cache_of(requests)
    ngram, continuations = query(cache, row, num=num, num_tokens=2)
    if ngram == 0:
        assert continuations == []
        return
    per_request = [occurrences_in([request], row[-ngram:], 2) for request in reversed(requests)]  # newest first
    assert len(continuations) == min(num, sum(map(len, per_request)))
    # whole requests from the newest, then part of the next one
    got, left = collections.Counter(map(tuple, continuations)), num
    for found in per_request:
        found = collections.Counter(map(tuple, found))
        if sum(found.values()) <= left:
            assert found <= got
            got, left = got - found, left - sum(found.values())
        else:
            assert got <= found and sum(got.values()) == left
            break


@SETTINGS
@given(st.lists(st.lists(st.integers(-1, 4), min_size=3, max_size=3), min_size=1, max_size=9),
       st.lists(st.booleans(), min_size=9, max_size=9))
def test_frequency_chain_takes_the_most_frequent_token_depth_by_depth(candidates, alive):
    """Reference: depth by depth, among the occurrences still agreeing, the most frequent token (ties: the first
    occurrence); counts and totals as counted by hand."""
    alive = alive[: len(candidates)]
    # (-1 marks a continuation's end: nothing after it)
    rows = [c[: c.index(-1)] + [-1] * (3 - c.index(-1)) if -1 in c else c for c in candidates]
    tokens, counts, chosen, total = frequency_chain(torch.tensor([rows]), torch.tensor([alive]))
    live = [i for i, keep in enumerate(alive) if keep]
    chain, expect_chosen, expect_total = [], [], []
    for depth in range(3):
        live = [i for i in live if rows[i][depth] >= 0]
        votes = collections.Counter(rows[i][depth] for i in live)
        expect_total.append(len(live))
        if not live:
            expect_chosen.append(0)
            break
        best = max(votes.values())
        token = next(rows[i][depth] for i in live if votes[rows[i][depth]] == best)
        chain.append(token)
        expect_chosen.append(best)
        live = [i for i in live if rows[i][depth] == token]
    assert int(counts[0]) == len(chain)
    assert tokens[0, : len(chain)].tolist() == chain
    assert chosen[0, : len(expect_chosen)].tolist() == expect_chosen
    assert total[0, : len(expect_total)].tolist() == expect_total
    # the counts add up: a depth's voters are those that agreed at the depth before, less those that ended
    for depth in range(2):
        assert total[0, depth + 1] <= chosen[0, depth] <= total[0, depth]
    shares = chosen / (total + 1)
    assert ((shares >= 0) & (shares < 1)).all()


def step_log_conditional(shares: torch.Tensor, unanimous: torch.Tensor, level: int) -> torch.Tensor:
    """A calibration stand-in whose path sums are exact in float32 and float64 (integers), so ties match the
    reference's; a split vote costs one more, and so does the first level (0)."""
    return -torch.floor((1 - shares) * 8) - 1 - (~unanimous).float() - float(level == 0)


def reference_tree(rows: list[list[int]], alive: list[bool], width: int) -> list[tuple]:
    """The frequency tree by hand, level by level: each frontier node's ``width`` most voted next tokens among the
    occurrences agreeing with its path (ties: the earliest occurrence), the ``width`` best candidates by path score
    kept (ties: parent, then rank). Returns ``(token, parent, depth, score, share, unanimous)`` per valid node,
    ``None`` elsewhere, in node order."""
    owner = {i: 0 for i, keep in enumerate(alive) if keep}
    frontier_scores, nodes = [0.0], []
    for level in range(len(rows[0])):
        owner = {i: f for i, f in owner.items() if rows[i][level] >= 0}
        candidates = []  # (score, parent, token, share, unanimous), parent-major then rank
        for f, parent_score in enumerate(frontier_scores):
            mine = sorted(i for i in owner if owner[i] == f)
            votes = collections.Counter(rows[i][level] for i in mine)
            first = {}
            for i in mine:
                first.setdefault(rows[i][level], i)
            ranked = sorted(first, key=lambda token: (-votes[token], first[token]))[:width]
            for rank in range(width):
                if rank < len(ranked) and parent_score > float("-inf"):
                    share, unanimous = votes[ranked[rank]] / (len(mine) + 1), votes[ranked[rank]] == len(mine)
                    score = parent_score - math.floor((1 - share) * 8) - 1 - (0 if unanimous else 1) - (level == 0)
                    candidates.append((score, f, ranked[rank], share, unanimous))
                else:
                    candidates.append((float("-inf"), f, None, 0.0, False))
        kept = sorted(candidates, key=lambda candidate: -candidate[0])[:width]  # (stable: ties keep their order)
        start = -1 if level == 0 else (level - 1) * width
        nodes += [None if token is None else (token, -1 if start < 0 else start + f, level + 1, score, share, agree)
                  for score, f, token, share, agree in kept]
        index = {(f, token): k for k, (_, f, token, *_) in enumerate(kept) if token is not None}
        owner = {i: index[(f, rows[i][level])] for i, f in owner.items() if (f, rows[i][level]) in index}
        frontier_scores = [score for score, *_ in kept]
    return nodes


@SETTINGS
@given(st.lists(st.lists(st.integers(-1, 3), min_size=3, max_size=3), min_size=1, max_size=9),
       st.lists(st.booleans(), min_size=9, max_size=9), st.integers(1, 3))
def test_frequency_tree_equals_a_trie_built_by_hand(candidates, alive, width):
    """The tree holds, level by level, the most voted distinct continuations of the occurrences (as the reference
    counts them), siblings distinct, scores falling along paths; with ``width = 1`` it is the frequency chain."""
    alive = alive[: len(candidates)]
    rows = [c[: c.index(-1)] + [-1] * (3 - c.index(-1)) if -1 in c else c for c in candidates]
    tree, shares, unanimous = frequency_tree(torch.tensor([rows]), torch.tensor([alive]), width,
                                             step_log_conditional)
    expected = reference_tree(rows, alive, width)
    assert tree.tokens.shape == (1, 3 * width)
    for node, want in enumerate(expected):
        assert bool(tree.valid[0, node]) == (want is not None), node
        if want is None:
            assert tree.log_scores[0, node] == float("-inf") and shares[0, node] == 0 and not unanimous[0, node]
            continue
        token, parent, depth, score, share, agree = want
        assert (int(tree.tokens[0, node]), int(tree.parents[0, node]), int(tree.depths[0, node])) == \
            (token, parent, depth), node
        assert float(tree.log_scores[0, node]) == score and abs(float(shares[0, node]) - share) < 1e-6
        assert bool(unanimous[0, node]) == agree
        if parent >= 0:  # a valid node's parent is valid and scores no lower
            assert tree.valid[0, parent] and tree.log_scores[0, parent] >= tree.log_scores[0, node]
    valid = tree.valid[0].tolist()
    siblings = collections.Counter((int(tree.parents[0, n]), int(tree.tokens[0, n])) for n in range(3 * width)
                                   if valid[n])
    assert max(siblings.values(), default=1) == 1
    if width == 1:
        chain, count, chosen, total = frequency_chain(torch.tensor([rows]), torch.tensor([alive]))
        assert tree.valid[0].sum() == count[0]
        assert tree.tokens[0, : int(count[0])].tolist() == chain[0, : int(count[0])].tolist()
        assert unanimous[0, : int(count[0])].tolist() == (chosen == total)[0, : int(count[0])].tolist()


def test_a_frequency_tree_of_no_levels_or_no_occurrence_has_no_valid_node():
    tree, shares, _ = frequency_tree(torch.zeros(2, 3, 0, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), 2,
                                  step_log_conditional)
    assert tree.tokens.shape == shares.shape == (2, 0)
    tree, shares, _ = frequency_tree(torch.tensor([[[4, 5]]]), torch.tensor([[False]]), 2, step_log_conditional)
    assert not tree.valid.any() and (tree.tokens == 0).all() and (shares == 0).all()  # (no -1 token for the target)


@SETTINGS
@given(st.lists(row_strategy, min_size=1, max_size=4), st.booleans())
def test_batch_matches_equal_a_row_by_row_search(rows, peers):
    """Every row's matches in every row (``peers``) or in itself only, and the continuations of the longest."""
    sequences = torch.full((len(rows), 10), 7)  # scratch past each row's end is never matched
    for index, row in enumerate(rows):
        sequences[index, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(row) for row in rows])
    context, tokens = batch_matches(sequences, torch.zeros_like(lengths), lengths, 3, peers)
    for b, row in enumerate(rows):
        for r, other in enumerate(rows if peers else [row]):
            for p in range(10):
                expected = 0
                if p + 1 < len(other):
                    while expected < min(3, p + 1, len(row)) and other[p - expected] == row[-1 - expected]:
                        expected += 1
                assert int(context[b, r * 10 + p]) == expected, (b, r, p)
    ngram = context.amax(dim=1)
    own = own_match_lengths(context, 10)
    alone = torch.ones(len(rows), dtype=torch.bool)
    for own_only in (None, alone):
        candidates, found = batch_continuations(tokens, context, ngram, 40, 2, own_only)
        for b, row in enumerate(rows):
            assert int(own[b]) == longest_in([row], row, 3)
            n = int(ngram[b])
            got = [[t for t in cand if t >= 0] for cand in candidates[b][found[b]].tolist()]
            searched = rows if peers and own_only is None else [row]
            expected = occurrences_in(searched, row[-n:], 2) if n else []
            assert collections.Counter(map(tuple, got)) == collections.Counter(map(tuple, expected))


@SETTINGS
@given(requests_strategy, st.lists(row_strategy, min_size=1, max_size=3), st.integers(1, 4))
def test_the_drafted_chain_is_a_continuation_seen_after_the_rows_last_tokens(requests, rows, num_tokens):
    """Whatever the batch and the cache hold, each row's chain follows an occurrence of its last ``n`` tokens (``n``
    the longest match in either) in a row of the batch or a cached request, and a row drafts iff one exists (every
    cell found drafted: ``min_prob=0``)."""
    drafter = SuffixCandidateGenerator(max_tokens=4, cache=cache_of(requests), occurrences=8, min_prob=0.0)
    prompts, mask = left_padded(rows)
    width = prompts.shape[1]
    drafter.prefill(prompts, mask)
    sequences = torch.cat([prompts, torch.zeros(len(rows), 4, dtype=torch.long)], dim=1)
    lengths = torch.full((len(rows),), width)
    drafts, counts, shares, unanimous, ngram, _ = drafter.draft(sequences, lengths, num_tokens)
    for b, row in enumerate(rows):
        n = int(ngram[b])
        assert n == longest_in(requests + rows, row, 3)
        chain = drafts[b, : int(counts[b])].tolist()
        seen = occurrences_in(requests + rows, row[-n:], num_tokens) if n else []
        assert (len(chain) > 0) == (len(seen) > 0)
        assert any(cont[: len(chain)] == chain for cont in seen) or not chain
        if n and longest_in([row], row, 3) == n:  # its own text matches as far as any: it alone votes
            assert any(cont[: len(chain)] == chain for cont in occurrences_in([row], row[-n:], num_tokens))
        assert (shares[b, : len(chain)] > 0).all() and (shares[b] < 1).all()


@SETTINGS
@given(requests_strategy, st.lists(row_strategy, min_size=1, max_size=3), st.floats(0.01, 0.99),
       st.lists(st.floats(0.0, 1.0), min_size=80, max_size=80))
def test_a_minimum_survival_keeps_the_longest_prefix_at_or_above_it(requests, rows, min_prob, rates):
    """Whatever the occurrences and the calibrated table, a drafter with ``min_prob`` drafts the uncut chain's longest
    prefix whose survival (the product of its cells' calibrated acceptance) is at least ``min_prob``."""
    prompts, mask = left_padded(rows)
    width = prompts.shape[1]
    results = []
    for floor in (0.0, min_prob):
        drafter = SuffixCandidateGenerator(max_tokens=4, cache=cache_of(requests), occurrences=8, min_prob=floor)
        drafter.prefill(prompts, mask)
        drafter.acceptance.prior = torch.tensor(rates).view(4, 2, 10)  # (no counts yet: the rates are the prior)
        sequences = torch.cat([prompts, torch.zeros(len(rows), 4, dtype=torch.long)], dim=1)
        results.append(drafter.draft(sequences, torch.full((len(rows),), width), 4))
    (drafts, counts, *_, log_probs), (cut_drafts, cut_counts, *_) = results
    for b in range(len(rows)):
        survival = log_probs[b].double().exp().cumprod(dim=0)
        assume(not ((survival - min_prob).abs() < 1e-5).any())  # (float rounding decides a cell at the boundary)
        expected = 0
        while expected < int(counts[b]) and float(survival[expected]) >= min_prob:
            expected += 1
        assert int(cut_counts[b]) == expected
        assert cut_drafts[b, :expected].tolist() == drafts[b, :expected].tolist()
        assert cut_drafts[b, expected:].tolist() == [int(prompts[b, -1])] * (4 - expected)  # the row's last token


def test_eviction_keeps_the_cap_and_the_newest_requests():
    cache = SuffixCache(max_requests=3, tokens_per_request=4, depth=2)
    size = cache.nbytes
    assert size == 3 * 4 * (8 + 12 * 2)
    for start in range(10):
        cache.add_token_lists([[start * 10 + i for i in range(6)]])  # 6 tokens: the last 4 kept
        assert cache.nbytes == size
        assert cache.num_requests == min(start + 1, 3)
    kept = {tuple(row) for row in cache.tokens.tolist()}
    assert kept == {(72, 73, 74, 75), (82, 83, 84, 85), (92, 93, 94, 95)}
    assert query(cache, [93], 8, 2) == (1, [[94, 95]])
    assert query(cache, [3], 8, 2) == (0, [])  # request 0 was evicted
    cache.add_token_lists([[1, 2]] * 5)  # more at once than the cap: the last 3 survive
    assert cache.tokens.tolist() == [[-1, -1, 1, 2]] * 3


def test_concurrent_adds_and_queries_keep_the_cache_consistent():
    """A stream's worker queries while a user seeds the cache from another thread."""
    cache = SuffixCache(max_requests=16, tokens_per_request=8, depth=2)
    errors = []

    def seed():
        for i in range(200):
            cache.add_token_lists([[1, 2, 3 + i % 5]])

    def read():
        for _ in range(200):
            with cache.lock:
                ngram, continuations = query(cache, [1, 2], 32, 1)
            if ngram and not all(cont and 3 <= cont[0] < 8 for cont in continuations):
                errors.append(continuations)

    threads = [threading.Thread(target=seed), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert cache.added == 200 and cache.num_requests == 16


def test_a_saved_cache_seeds_an_equal_one_from_its_file(tmp_path):
    """``save`` writes the requests held oldest first (after the ring wrapped too) as JSON lines; ``from_file`` reads
    them into a cache that holds the same tokens in the same order and finds the same continuations."""
    requests = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [2, 3, 12], [13, 2, 3, 14]]
    cache = cache_of(requests, max_requests=3, width=5)  # the ring wrapped: holds requests 2-4 (last 5 tokens each)
    path = tmp_path / "seed.jsonl"
    assert cache.save(path) == 3
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [[11], [2, 3, 12], [13, 2, 3, 14]]
    seeded = SuffixCache.from_file(path, max_requests=3, tokens_per_request=5, depth=3)
    assert seeded.num_requests == 3 and seeded.add_file(path) == 3  # (again: the ring takes them in order)
    for row in ([2, 3], [4, 11], [13]):
        assert query(seeded, row, 8, 2) == query(cache, row, 8, 2)
    assert query(seeded, [2, 3], 8, 2) == (2, [[14], [12]])  # the newest request first
    empty = SuffixCache(max_requests=2)
    assert empty.save(tmp_path / "empty.jsonl") == 0 and (tmp_path / "empty.jsonl").read_text() == ""


def test_a_seed_file_skips_blank_lines_and_keeps_long_requests_tail(tmp_path):
    path = tmp_path / "seed.jsonl"
    path.write_text("[1, 2, 3, 4, 5, 6]\n\n   \n[]\n[7, 8]\n")
    cache = SuffixCache.from_file(path, vocab_size=9, max_requests=4, tokens_per_request=4, depth=2)
    assert cache.num_requests == 2
    assert cache.tokens[:2].tolist() == [[3, 4, 5, 6], [-1, -1, 7, 8]]


@pytest.mark.parametrize("line, words", [
    ("[1, 2", "not JSON"),
    ('{"tokens": [1, 2]}', "a JSON dict, not an array of token ids"),
    ("[1, -2]", "token -2 at position 1 is not an integer >= 0"),
    ("[1, 2.5]", "token 2.5 at position 1 is not an integer >= 0"),
    ("[true]", "token True at position 0 is not an integer >= 0"),
    ('["a"]', "token 'a' at position 0"),
    ("[3, 40]", "token 40 at position 1 is not below the vocabulary size 32"),
])
def test_a_bad_seed_file_is_refused_naming_its_line(tmp_path, line, words):
    path = tmp_path / "seed.jsonl"
    path.write_text("[1, 2, 3]\n\n" + line + "\n[4]\n")
    cache = SuffixCache(max_requests=4)
    with pytest.raises(ValueError, match=rf"seed\.jsonl:3: {re.escape(words)}"):
        cache.add_file(path, vocab_size=32)
    assert cache.added == 0  # nothing was added


@pytest.mark.parametrize("name, value", [("max_requests", 0), ("tokens_per_request", 1), ("depth", True)])
def test_bad_cache_sizes_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        SuffixCache(**{name: value})
