"""Suffix drafts in the loop (tetris_suffix_num_tokens), chains and trees (tetris_tree_width > 1): greedy rows equal
the target alone in generate(), in the request stream with rows joining and (chains) in hybrid with a draft model;
sampled rows follow the target's law (and a broken rejection, or a broken tree rule, fails that test); finished rows
reach the cache; a step reads the device at most twice; bad settings are refused by name before any forward."""

import functools
import math

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import tetris_hf.logits.verification as verification
import tetris_hf.tree_step as tree_step
import tetris_hf.trees as trees
import test_sampling_distribution as sampling
from tetris_hf.candidate_generators.suffix import SuffixCandidateGenerator
from tetris_hf.stream import RequestStream
from tetris_hf.suffix_cache import SuffixCache
from test_greedy_exactness import assert_rows_equal, pick_eos, target_alone
from test_prompt_lookup import lookup_generate, repetitive_prompts, sampled_model_free_joint
from test_stream import check_exact, requests
from tiny_models import EOS, PAD, left_pad, noisy_copy, sharpen, tiny_llama

STRATEGIES = [
    ("tetris", {}),
    ("tetris", {"tetris_budget": 2}),  # a partial budget: TETRIS ranks suffix cells across rows
    ("fixed", {}),
    ("fixed", {"tetris_suffix_min_prob": 0.0}),  # every cell found drafted, however unlikely
    ("adaptive", {"tetris_cost_profile": sampling.CHEAP_VERIFY}),
    ("dsd", {"tetris_cost_profile": sampling.CHEAP_VERIFY}),
]


@pytest.fixture(scope="module")
def repetitive_target():
    """A target peaked enough to repeat itself, so suffix drafts are often right (and sometimes wrong)."""
    return sharpen(tiny_llama(vocab_size=24, num_layers=2, seed=3), 6.0)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("strategy,options", STRATEGIES)
def test_greedy_rows_equal_the_target_alone(repetitive_target, batch_size, strategy, options):
    prompts = repetitive_prompts(batch_size, 24, seed=batch_size)
    eos = pick_eos(repetitive_target, prompts) if batch_size > 1 else EOS  # some rows stop early
    references = target_alone(repetitive_target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    out = lookup_generate(repetitive_target, input_ids, mask, eos, tetris_suffix_num_tokens=3,
                          tetris_strategy=strategy, **options)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    stats = out.tetris_stats
    assert stats.emitted_tokens == sum(len(reference) for reference in references)
    if strategy != "adaptive":
        assert stats.accepted_tokens > 0  # suffix drafts were made, and right at times


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("strategy,options", STRATEGIES)
def test_greedy_tree_rows_equal_the_target_alone(repetitive_target, batch_size, strategy, options):
    """Suffix trees (``tetris_tree_width > 1``): the most voted distinct continuations, nodes selected across rows."""
    prompts = repetitive_prompts(batch_size, 24, seed=batch_size)
    eos = pick_eos(repetitive_target, prompts) if batch_size > 1 else EOS
    references = target_alone(repetitive_target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    width = 3 if strategy == "fixed" else 2
    out = lookup_generate(repetitive_target, input_ids, mask, eos, tetris_suffix_num_tokens=3,
                          tetris_tree_width=width, tetris_strategy=strategy, **options)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    stats = out.tetris_stats
    assert stats.emitted_tokens == sum(len(reference) for reference in references)
    if strategy != "adaptive":  # (which may find plain steps cheaper)
        assert stats.accepted_tokens > 0
    if batch_size > 1 and strategy in ("tetris", "fixed"):
        assert stats.verified_tokens < stats.drafted_tokens  # the trees branched beyond what was verified


def test_a_tree_verdict_calibrates_the_nodes_whose_parent_was_reached():
    """A node counts as tried when it was verified and its parent reached (the root, or a node on the accepted path),
    as accepted when it is on the path; nodes below a rejection or never verified tell nothing."""
    from tetris_hf.step import ReadHints, StepTree, Verdict

    cache = SuffixCache(max_requests=4, tokens_per_request=16)
    cache.add_token_lists([[3, 4, 5, 6], [3, 4, 5, 7], [3, 4, 8, 9]])
    drafter = SuffixCandidateGenerator(max_tokens=2, cache=cache)
    sequences = torch.tensor([[1, 3, 4, 0, 0, 0]])
    drafter.prefill(sequences[:, :3], torch.ones(1, 3, dtype=torch.long))
    grown = drafter.propose(sequences, torch.tensor([3]), 2, tree_width=2)
    tree = grown.tree  # depth 1: 5 (2 of 3 votes), 8 (1); depth 2: 5's children 7, 6 (newest first)
    assert tree.tokens[0].tolist() == [5, 8, 7, 6] and tree.parents[0].tolist() == [-1, -1, 0, 0]
    assert grown.expanded_log_probs is None  # verified by matching when sampling
    selected = torch.tensor([[True, True, True, False]])
    path = torch.tensor([[1, -1]])  # 8 accepted (5 rejected: its verified child 7 tells nothing; 6 unverified)
    verdict = Verdict(torch.tensor([1]), torch.tensor([2]), selected.sum(dim=1),
                      StepTree(tree, selected, torch.tensor([4]), path, torch.tensor([1]), torch.tensor([2])),
                      ReadHints(max_accepted=2))
    drafter.accept(verdict)
    shares = drafter.acceptance.cells(torch.tensor([[2 / 4, 1 / 4, 1 / 3]]), torch.tensor([[False, False, False]]),
                                      torch.tensor([[2, 2, 3]]))[0].tolist()  # (a 2-token match, plus the level)
    tried, accepted = drafter.acceptance.tried.flatten(), drafter.acceptance.accepted.flatten()
    assert tried.sum() == 2 and accepted.sum() == 1
    assert [float(tried[cell]) for cell in shares] == [1.0, 1.0, 0.0]
    assert float(accepted[shares[1]]) == 1.0


def test_unanimous_and_split_votes_of_the_same_share_are_calibrated_apart():
    """One occurrence (share 1/2, unanimous) and a 2-of-3 split (share 1/2) fall in one share bin; the table keeps
    them apart, as the first is accepted far more often (a copy of the row's own text, say)."""
    from tetris_hf.candidate_generators.suffix import SuffixAcceptance

    acceptance = SuffixAcceptance(torch.device("cpu"))
    shares, unanimous, ngram = torch.full((2, 1), 0.5), torch.tensor([[True], [False]]), torch.tensor([4, 4])
    for _ in range(50):  # row 0's cell accepted, row 1's rejected
        acceptance.update(shares, unanimous, ngram, torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long),
                          torch.tensor([1, 0]))
    rates = acceptance.log_probs(shares, unanimous, ngram).exp()[:, 0]
    assert rates[0] > 0.9 and rates[1] < 0.1


def test_a_chain_cell_is_calibrated_by_its_match_plus_the_cells_before_it():
    """After a one-token match the first cell's context is 1 token, the second's 2 and the fourth's 4: each is counted
    in its own class (1; 2-3; 4-7), so a deep cell of an accepted path is not ranked as a first cell of its share."""
    from tetris_hf.candidate_generators.suffix import LENGTH_CLASSES, SuffixAcceptance

    acceptance = SuffixAcceptance(torch.device("cpu"))
    shares, unanimous = torch.full((1, 4), 0.5), torch.ones(1, 4, dtype=torch.bool)
    acceptance.update(shares, unanimous, torch.tensor([1]), torch.tensor([4]), torch.tensor([4]), torch.tensor([4]))
    tried = acceptance.tried[:, 1, 5]  # (classes,) unanimous, share bin 5
    assert len(LENGTH_CLASSES) == 4 and tried.tolist() == [1.0, 2.0, 1.0, 0.0]
    assert acceptance.tried.sum() == 4 == acceptance.accepted.sum()


def even_odds_drafter(min_prob: float) -> SuffixCandidateGenerator:
    """A drafter over one row ``1 2 3 4 5 6 7 1 2`` (after ``1 2`` came ``3 4 5``), every cell's calibrated acceptance
    0.5: survivals 0.5, 0.25, 0.125."""
    drafter = SuffixCandidateGenerator(max_tokens=3, min_prob=min_prob)
    sequences = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 1, 2]])
    drafter.prefill(sequences, torch.ones_like(sequences))
    drafter.acceptance.tried.fill_(1e6)
    drafter.acceptance.accepted.fill_(5e5)
    return drafter


@pytest.mark.parametrize("min_prob,drafted", [(0.0, 3), (0.2, 2), (0.3, 1), (0.6, 0)])
def test_a_chain_stops_where_its_survival_falls_below_the_minimum(min_prob, drafted):
    drafter = even_odds_drafter(min_prob)
    sequences = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 1, 2, 0, 0, 0]])
    proposal = drafter.propose(sequences, torch.tensor([9]), 3)
    assert proposal.lengths.tolist() == [drafted]
    assert proposal.tokens[0].tolist() == [3, 4, 5][:drafted] + [2] * (3 - drafted)  # past the count: the last token
    assert sequences[0, 9:].tolist() == proposal.tokens[0].tolist()
    assert proposal.log_probs[0].isfinite().tolist() == [cell < drafted for cell in range(3)]


@pytest.mark.parametrize("min_prob,depths", [(0.0, 3), (0.2, 2), (0.3, 1)])
def test_tree_nodes_below_the_minimum_survival_are_not_candidates(min_prob, depths):
    drafter = even_odds_drafter(min_prob)
    sequences = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 1, 2, 0, 0, 0]])
    tree = drafter.propose(sequences, torch.tensor([9]), 3, tree_width=2).tree
    valid = tree.valid[0]
    assert tree.tokens[0][valid].tolist() == [3, 4, 5][:depths]  # (one occurrence: one node a level)
    assert (tree.log_scores[0][valid] >= math.log(max(min_prob, 1e-9))).all()


def test_finished_rows_fill_the_cache_and_a_seeded_cache_drafts(repetitive_target):
    """A shared cache keeps every row of a call (padding left out); a second call on fresh prompts drafts from it
    what the first wrote, and stays exact."""
    cache = SuffixCache(max_requests=16, tokens_per_request=64)
    prompts = repetitive_prompts(4, 24, seed=5)
    references = target_alone(repetitive_target, prompts, EOS)
    input_ids, mask = left_pad(prompts)
    out = lookup_generate(repetitive_target, input_ids, mask, EOS, tetris_suffix_num_tokens=3,
                          tetris_suffix_cache=cache)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    assert cache.added == 4
    held = sorted(tuple(token for token in row if token >= 0) for row in cache.tokens[:4].tolist())
    assert held == sorted(tuple(prompt + reference) for prompt, reference in zip(prompts, references))
    # the same prompts again, each alone: the cache holds its whole answer, so nearly every step accepts all k
    fresh = lookup_generate(repetitive_target, *left_pad(prompts[:1]), EOS, tetris_suffix_num_tokens=3,
                            tetris_suffix_cache=cache, tetris_strategy="fixed")
    cold = lookup_generate(repetitive_target, *left_pad(prompts[:1]), EOS, tetris_suffix_num_tokens=3,
                           tetris_strategy="fixed")
    assert fresh.sequences[0].tolist() == cold.sequences[0].tolist()
    assert fresh.tetris_stats.accepted_tokens > cold.tetris_stats.accepted_tokens


@pytest.mark.parametrize("strategy", ["tetris", "fixed", "adaptive"])
@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
def test_stream_rows_equal_target_alone(strategy, max_batch_size):
    """Rows join mid-stream (their prompts read while others decode), finished ones feed the cache."""
    target = sharpen(tiny_llama(seed=0), 4.0)
    cache = SuffixCache(max_requests=8, tokens_per_request=32)
    stream = RequestStream(target, max_batch_size=max_batch_size, prefill_chunk=5, eos_token_id=None,
                           tetris_strategy=strategy, tetris_suffix_num_tokens=3, tetris_suffix_cache=cache)
    check_exact(target, stream, requests(target, 12, seed=40 + max_batch_size, max_prompt=16))
    assert cache.added == 12 and cache.num_requests == 8


@pytest.mark.parametrize("strategy", ["tetris", "fixed", "adaptive"])
@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
def test_stream_tree_rows_equal_target_alone(strategy, max_batch_size):
    """Suffix trees in the stream: rows join (their prompts read in forwards of their own), finished ones feed the
    cache the next rows' trees draw from."""
    target = sharpen(tiny_llama(seed=0), 4.0)
    cache = SuffixCache(max_requests=8, tokens_per_request=32)
    stream = RequestStream(target, max_batch_size=max_batch_size, prefill_chunk=5, eos_token_id=None,
                           tetris_strategy=strategy, tetris_suffix_num_tokens=3, tetris_tree_width=2,
                           tetris_suffix_cache=cache)
    check_exact(target, stream, requests(target, 12, seed=60 + max_batch_size, max_prompt=16))
    assert cache.added == 12


def test_generate_batch_takes_the_option():
    target = sharpen(tiny_llama(seed=0), 4.0)
    prompts = [prompt for prompt, _, _ in requests(target, 6, seed=3, max_prompt=12)]
    outputs = tetris_hf.generate_batch(target, prompts, max_new_tokens=10, eos_token_id=None, max_batch_size=3,
                                       tetris_suffix_num_tokens=2)
    from test_stream import alone
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == alone(target, prompt, 10)


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny_llama(vocab_size=24, num_layers=2, seed=3), 6.0)
    return target, noisy_copy(target, 0.5)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("strategy,options", STRATEGIES)
def test_hybrid_greedy_rows_equal_the_target_alone(pair, batch_size, strategy, options):
    """A draft model beside suffix drafts: each row drafts from the cache where it matches, the model elsewhere."""
    target, draft = pair
    prompts = repetitive_prompts(batch_size, 24, seed=10 + batch_size)
    eos = pick_eos(target, prompts) if batch_size > 1 else EOS
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    out = lookup_generate(target, input_ids, mask, eos, assistant_model=draft, tetris_suffix_num_tokens=3,
                          tetris_strategy=strategy, **options)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    if strategy != "adaptive" and batch_size > 1:  # the suffix part drafted, and was right at times
        assert out.tetris_stats.lookup_accepted_tokens > 0


@pytest.mark.parametrize("strategy", ["tetris", "adaptive"])
def test_hybrid_stream_rows_equal_target_alone(pair, strategy):
    target, draft = pair
    stream = RequestStream(target, assistant_model=draft, max_batch_size=3, prefill_chunk=5, eos_token_id=None,
                           tetris_strategy=strategy, tetris_suffix_num_tokens=3)
    check_exact(target, stream, requests(target, 8, seed=50, max_prompt=16))


# -- sampling: deterministic drafts verified as lookup's are ---------------------------------------------------------

SUFFIX_PROMPT = [3, 4, 5, 3, 4, 5, 3]


def sampled_suffix_joint(target, strategy, seed=0, **options):
    """12,000 rows of one prompt, the first four sampled tokens counted; the cache is seeded with continuations of
    the prompt (so most cells come from it), the rows also search themselves."""
    cache = SuffixCache(max_requests=8, tokens_per_request=16)
    cache.add_token_lists([SUFFIX_PROMPT + [4, 5, 3, 4], SUFFIX_PROMPT + [4, 2, 2], SUFFIX_PROMPT + [4, 5, 0]])
    return sampled_model_free_joint(target, strategy, seed, tetris_suffix_cache=cache, **options)


@pytest.fixture
def suffix_sampling(monkeypatch):
    monkeypatch.setattr(sampling, "PROMPT", SUFFIX_PROMPT)
    target = sharpen(tiny_llama(sampling.VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    return target, sampling.exact_joint(target, 1.0, 1.0, new_tokens=4)


@pytest.mark.parametrize("strategy,options", [
    ("tetris", {"tetris_suffix_num_tokens": 2, "tetris_extra_tokens": 1, "tetris_budget": sampling.ROWS}),
    ("fixed", {"tetris_suffix_num_tokens": 2}),
])
def test_sampled_sequences_follow_the_target_distribution(suffix_sampling, strategy, options):
    """The joint law of the first four tokens, with a partial budget (TETRIS verifies C = B of 3B cells)."""
    target, joint = suffix_sampling
    counts, stats = sampled_suffix_joint(target, strategy, **options)
    assert 0 < stats.accepted_tokens < stats.verified_tokens  # both branches taken
    if strategy == "tetris":
        assert stats.verified_tokens < stats.drafted_tokens  # selection left cells out
    assert sampling.chi_square_p_value(counts, joint) > 1e-3


def test_chi_square_catches_a_rejection_that_keeps_the_drafted_token(suffix_sampling, monkeypatch):
    """Teeth: after a rejected suffix draft, sampling from ``p`` (not ``p`` without the draft) is biased."""
    target, joint = suffix_sampling
    monkeypatch.setattr(verification, "residual_distribution", lambda target_probs, draft_probs: (target_probs, None))
    counts, _ = sampled_suffix_joint(target, "fixed", tetris_suffix_num_tokens=2)
    assert sampling.chi_square_p_value(counts, joint) < 1e-3


def likely_continuations(target, prompt: list[int], depth: int = 3, width: int = 2) -> list[list[int]]:
    """``prompt`` followed by every path of the target's ``width`` likeliest tokens, ``depth`` deep, each repeated
    ``1 + round(8 p)`` times (``p`` the path's probability): a cache whose trees branch where the target has mass."""
    out = []

    def walk(path: list[int], probability: float) -> None:
        if len(path) == depth:
            out.extend([prompt + path] * (1 + round(8 * probability)))
            return
        with torch.no_grad():
            law = target(torch.tensor([prompt + path])).logits[0, -1].softmax(-1)
        top = law.topk(width)
        for token_probability, token in zip(top.values.tolist(), top.indices.tolist()):
            walk(path + [token], probability * token_probability)

    walk([], 1.0)
    return out


def sampled_tree_joint(target, strategy, monkeypatch, seed=0, **options):
    """12,000 rows of one prompt drafting suffix trees from a cache of the target's likely continuations, kept as
    seeded (the rows that stop are not added: the tree's contents do not matter to the law, and thousands of rows
    stopping at once would evict the seeds), the first four sampled tokens counted."""
    monkeypatch.setattr(SuffixCandidateGenerator, "remember", lambda self, *finished: None)
    cache = SuffixCache(max_requests=64, tokens_per_request=16)
    cache.add_token_lists(likely_continuations(target, SUFFIX_PROMPT))
    return sampled_model_free_joint(target, strategy, seed, tetris_suffix_cache=cache, tetris_suffix_num_tokens=2,
                                    **options)


SAMPLED_TREES = [  # each with a seed of its own: under one seed the matching rule can emit the very same draws
    # whatever the tree (it decides only how far one forward's draws reach; tetris and fixed did), testing one sample
    ("tetris", {"tetris_tree_width": 2, "tetris_extra_tokens": 1, "tetris_budget": sampling.ROWS, "seed": 1}),
    ("fixed", {"tetris_tree_width": 2, "seed": 0}),
    ("adaptive", {"tetris_tree_width": 3, "tetris_cost_profile": sampling.CHEAP_VERIFY, "seed": 2}),
]


@pytest.mark.parametrize("strategy,options", SAMPLED_TREES)
def test_sampled_tree_sequences_follow_the_target_distribution(suffix_sampling, strategy, options, monkeypatch):
    """Deterministic trees verified by a draw from the target's law at each node, followed while it lands on a
    child (``trees.accept_tree_matching``): the joint law of the first four tokens."""
    target, joint = suffix_sampling
    if strategy == "adaptive":  # (four tokens a row: its first probe at the first step, so that it drafts at all)
        from tetris_hf.strategies import AdaptiveBudget

        monkeypatch.setattr(AdaptiveBudget, "first_probe_after", 0)
    counts, stats = sampled_tree_joint(target, strategy, monkeypatch, **options)
    assert 0 < stats.accepted_tokens < stats.verified_tokens < stats.drafted_tokens  # branches left out, some taken
    assert sampling.chi_square_p_value(counts, joint) > 1e-3


def test_chi_square_catches_children_tried_each_by_its_own_odds(suffix_sampling, monkeypatch):
    """Teeth: the chain's one-hot rule applied to each sibling in turn (child ``j`` accepted with probability
    ``p(c_j)``, not ``p(c_j) / (1 - p(c_1) - ... - p(c_{j-1}))``; then a draw from ``p`` without the tried children)
    under-emits later siblings, and the test sees it."""
    target, joint = suffix_sampling

    def each_by_its_own_odds(block_tokens, block_parents, target_probs, max_depth, generator=None):
        rows = torch.arange(block_tokens.shape[0])
        current = torch.zeros_like(rows)
        path = torch.full((len(rows), max_depth), -1)
        stopped = torch.zeros_like(rows, dtype=torch.bool)
        next_tokens = torch.zeros_like(rows)
        for level in range(max_depth + 1):
            law = target_probs[rows, current]  # (B, V)
            children = (block_parents == current[:, None]) & (level < max_depth)  # (B, S)
            moved = torch.zeros_like(stopped)
            for slot in range(1, block_tokens.shape[1]):
                odds = law[rows, block_tokens[:, slot]]
                accept = children[:, slot] & ~stopped & ~moved & (torch.rand(len(rows)) < odds)
                current, moved = torch.where(accept, slot, current), moved | accept
            if level < max_depth:
                path[:, level] = torch.where(moved, current, -1)
            tried = torch.zeros_like(law).scatter_add_(1, block_tokens, children.float()) > 0
            rest = law.masked_fill(tried, 0.0)
            stop = ~stopped & ~moved
            next_tokens = torch.where(stop, verification.sample_tokens(rest / rest.sum(dim=1, keepdim=True)),
                                      next_tokens)
            stopped |= stop
        return trees.TreeAcceptance(path, (path >= 0).sum(dim=1), next_tokens)

    monkeypatch.setattr(tree_step, "accept_tree_matching", each_by_its_own_odds)
    counts, _ = sampled_tree_joint(target, "fixed", monkeypatch, tetris_tree_width=2)
    assert sampling.chi_square_p_value(counts, joint) < 1e-3


# -- refusals and reads ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options,message", [
    ({"tetris_suffix_num_tokens": 0}, "tetris_suffix_num_tokens` must be >= 1"),
    ({"tetris_suffix_num_tokens": "3"}, "tetris_suffix_num_tokens` must be an integer"),
    ({"tetris_suffix_num_tokens": 2, "prompt_lookup_num_tokens": 2}, "pass one of them"),
    ({"tetris_suffix_num_tokens": 2, "num_assistant_tokens": 3}, "make them equal"),
    ({"tetris_suffix_num_tokens": 2, "assistant_model": "DRAFT", "tetris_draft_vocab": 10},
     "not supported with suffix drafts"),
    ({"tetris_suffix_num_tokens": 2, "assistant_model": "DRAFT", "tetris_tree_width": 2},
     "tetris_tree_width` > 1 with `tetris_suffix_num_tokens` beside an `assistant_model`"),
    ({"prompt_lookup_num_tokens": 2, "tetris_tree_width": 2}, "prompt lookup drafts one continuation"),
    ({"tetris_suffix_cache": SuffixCache(max_requests=2)}, "pass `tetris_suffix_num_tokens=` too"),
    ({"tetris_suffix_num_tokens": 2, "tetris_suffix_cache": {}}, "tetris_suffix_cache` must be"),
    ({"tetris_suffix_min_prob": 0.2}, "tetris_suffix_min_prob` applies to suffix drafts"),
    ({"tetris_suffix_num_tokens": 2, "tetris_suffix_min_prob": 1.0}, r"tetris_suffix_min_prob` must be a number in \[0, 1\)"),
    ({"tetris_suffix_num_tokens": 2, "tetris_suffix_min_prob": "0.1"}, "tetris_suffix_min_prob` must be a number"),
])
def test_bad_suffix_settings_are_refused_before_any_forward(options, message, monkeypatch):
    target = tiny_llama(vocab_size=32)
    draft = noisy_copy(target, 0.1)
    options = {key: (draft if value == "DRAFT" else value) for key, value in options.items()}

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(target, "forward", functools.wraps(target.forward)(no_forward))  # (its signature kept)
    input_ids, mask = left_pad([[3, 4, 3, 4], [5, 6]])
    with pytest.raises((ValueError, TypeError), match=message):
        target.generate(input_ids, attention_mask=mask, custom_generate="tetris", max_new_tokens=4, **options)


@pytest.mark.parametrize("strategy,width", [("tetris", 1), ("fixed", 1), ("tetris", 2), ("fixed", 3)])
def test_a_suffix_step_reads_the_device_at_most_twice(repetitive_target, strategy, width):
    """Suffix drafting (chains or trees) reads nothing, and rows finishing into the cache read nothing either."""
    from test_host_reads import host_reads

    prompts = repetitive_prompts(8, 24, seed=4)
    input_ids, mask = left_pad(prompts)
    with host_reads.HostReads() as reads:
        repetitive_target.generate(input_ids, attention_mask=mask, custom_generate="tetris", max_new_tokens=30,
                                   tetris_suffix_num_tokens=3, tetris_tree_width=width, tetris_strategy=strategy,
                                   eos_token_id=EOS,
                                   pad_token_id=PAD, tetris_step_callback=reads.step_done)
    steady = reads.per_step[2:-1]
    assert len(steady) >= 5
    assert max(steady) <= 2, reads.per_step


def test_many_rows_search_themselves_only():
    """Above the peer budget each row searches itself (the cache still spans every row): drafts equal a
    one-row drafter's."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 6, (64, 40), generator=generator)
    batched = SuffixCandidateGenerator(max_tokens=3)
    batched.prefill(rows, torch.ones_like(rows))
    import tetris_hf.candidate_generators.suffix as suffix
    assert 64 * 64 * 40 * batched.depth > suffix.PEER_BUDGET // 64  # (the budget below is crossed)
    original = suffix.PEER_BUDGET
    try:
        suffix.PEER_BUDGET = 0
        drafts, counts, *_ = batched.draft(rows.clone(), torch.full((64,), 40), 3)
    finally:
        suffix.PEER_BUDGET = original
    for index in range(0, 64, 9):
        alone = SuffixCandidateGenerator(max_tokens=3)
        alone.prefill(rows[index : index + 1], torch.ones_like(rows[index : index + 1]))
        one, count, *_ = alone.draft(rows[index : index + 1].clone(), torch.tensor([40]), 3)
        assert int(counts[index]) == int(count[0])
        assert drafts[index, : int(count[0])].tolist() == one[0, : int(count[0])].tolist()
