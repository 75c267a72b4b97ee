"""Prompt-lookup drafts (no draft model): the batched lookup equals a row-by-row search, greedy rows equal the target
alone, sampled rows follow the target's law, and bad settings are refused before any forward."""

import itertools

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import tetris_hf.logits.verification as verification
import test_sampling_distribution as sampling
from tetris_hf.candidate_generators.prompt_lookup import CONTEXT_TOKENS, OCCURRENCES, LookupAcceptance, lookup_drafts
from tetris_hf.cost_model import CostProfile
from test_greedy_exactness import NEW_TOKENS, assert_rows_equal, pick_eos, target_alone
from tiny_models import EOS, PAD, left_pad, noisy_copy, random_prompts, sharpen, tiny_llama


def lookup_one_row(tokens: list[int], num_tokens: int, sizes: range, occurrence: str = "best",
                   context_tokens: int = CONTEXT_TOKENS) -> tuple[list[int], int]:
    """The reference: row by row, longest n first; among that n-gram's earlier occurrences followed by a token, the
    latest, the earliest, or (best) the one with the most tokens to copy (at most K), then the longest match with the
    row's end (at most ``context_tokens``), then the latest."""

    def context(end: int) -> int:  # tokens ending at `end` that equal the row's last ones
        matched = 0
        while matched < min(context_tokens, end + 1) and tokens[end - matched] == tokens[-1 - matched]:
            matched += 1
        return matched

    for size in sorted(sizes, reverse=True):
        if size >= len(tokens):
            continue
        suffix = tokens[-size:]
        starts = [start for start in range(len(tokens) - size) if tokens[start : start + size] == suffix]
        if not starts:
            continue
        if occurrence == "latest":
            start = max(starts)
        elif occurrence == "earliest":
            start = min(starts)
        else:
            start = max(starts, key=lambda start: (min(len(tokens) - start - size, num_tokens),
                                                   context(start + size - 1), start))
        return tokens[start + size : start + size + num_tokens], size
    return [], 0


@pytest.mark.parametrize("seed", range(6))
def test_batched_lookup_equals_a_row_by_row_search(seed):
    generator = torch.Generator().manual_seed(seed)
    vocab = 3 + seed  # small vocabularies repeat n-grams often
    prompts = [torch.randint(3, 3 + vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 24, (7,), generator=generator)]
    prompts[0] = [5]  # one real token: nothing to match
    sequences, mask = left_pad(prompts, pad=3)  # padding that equals real tokens must never match
    sequences = torch.cat([sequences, torch.full((7, 6), 4)], dim=1)  # scratch past the ends: never matched
    starts = sequences.shape[1] - 6 - mask.sum(dim=1)
    lengths = torch.full((7,), mask.shape[1])
    for sizes, num_tokens, occurrence in itertools.product((range(1, 4), range(2, 3), range(1, 2)), (1, 3, 5),
                                                           OCCURRENCES):
        drafts, counts, ngram = lookup_drafts(sequences, starts, lengths, num_tokens, sizes, occurrence=occurrence)
        for row, prompt in enumerate(prompts):
            expected, size = lookup_one_row(prompt, num_tokens, sizes, occurrence)
            assert int(ngram[row]) == size, (row, prompt, sizes)
            assert int(counts[row]) == len(expected)
            assert drafts[row, : len(expected)].tolist() == expected


def test_best_occurrence_prefers_more_to_copy_then_a_longer_match():
    """The row ends ``a x y z``; ``x y z`` occurred after ``b`` (early, much to copy after it) and after ``a`` (4
    tokens from the end: 5 to copy). K = 3: both have 3 to copy, so the longer match (``a x y z``) wins. K = 6: the
    early one has 6 to copy, the late one 5: the early one wins. The latest rule takes the late one both times."""
    a, b, x, y, z = 10, 11, 12, 13, 14
    row = [b, x, y, z, 1, 2, 3, 4, 5, 6, a, x, y, z, 7, a, x, y, z]
    sequences, starts, lengths = torch.tensor([row]), torch.tensor([0]), torch.tensor([len(row)])
    for num_tokens, expected in ((3, [7, a, x]), (6, [1, 2, 3, 4, 5, 6])):
        drafts, counts, ngram = lookup_drafts(sequences, starts, lengths, num_tokens, range(1, 4))
        assert (drafts[0].tolist(), int(counts[0]), int(ngram[0])) == (expected, num_tokens, 3)
        latest, _, _ = lookup_drafts(sequences, starts, lengths, num_tokens, range(1, 4), occurrence="latest")
        assert latest[0, :3].tolist() == [7, a, x]


def test_lookup_never_drafts_past_the_row_end():
    """E.g. ``[a b c d b c]``: ``b c`` at 1 is followed by ``d b c``, the row's end; K = 5 still drafts 3 cells."""
    sequences = torch.tensor([[7, 8, 9, 10, 8, 9, 0, 0, 0]])
    drafts, counts, ngram = lookup_drafts(sequences, torch.tensor([0]), torch.tensor([6]), 5, range(1, 3))
    assert (int(counts[0]), int(ngram[0])) == (3, 2)
    assert drafts[0, :3].tolist() == [10, 8, 9]


def test_acceptance_estimates_follow_what_the_target_accepted():
    """Cells the target reached are counted: accepted up to ``num_accepted``, the next one rejected, later ones not
    counted at all; a row that matched nothing gets ``-inf``."""
    estimate = LookupAcceptance(max_ngram_size=2, num_cells=3, device=torch.device("cpu"), prior_strength=1.0,
                                memory=1.0)
    prior = estimate.log_probs(torch.tensor([2]), 3).exp()
    for _ in range(50):  # 2-gram rows: cell 0 always accepted, cell 1 always rejected
        estimate.update(torch.tensor([2, 1]), verify_lengths=torch.tensor([3, 0]), num_accepted=torch.tensor([1, 0]))
    rates = estimate.log_probs(torch.tensor([2, 1, 0]), 3).exp()
    assert rates[0, 0] > 0.95 and rates[0, 1] < 0.05
    assert torch.isclose(rates[0, 2], prior[0, 2])  # never reached: still the prior
    assert torch.allclose(rates[1], prior[0])  # 1-gram rows verified nothing
    assert torch.isinf(estimate.log_probs(torch.tensor([0]), 3)).all()


def lookup_generate(target, input_ids, mask, eos, **options):
    return target.generate(input_ids, attention_mask=mask, custom_generate="tetris", do_sample=False,
                           max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD,
                           return_dict_in_generate=True, **options)


def repetitive_prompts(batch_size: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a motif (lookup finds matches) mixed with random ones (some rows never match)."""
    prompts = random_prompts(batch_size, vocab, seed, min_length=1, max_length=12)
    for row in range(0, batch_size, 2):
        motif = prompts[row][:3] or [5]
        prompts[row] = (motif * 5)[: 3 + 2 * (row % 5)]
    prompts[-1] = [7]  # a one-token row: no earlier n-gram at first
    return prompts


@pytest.fixture(scope="module")
def repetitive_target():
    """A target peaked enough to repeat itself, so lookup drafts are often right (and sometimes wrong)."""
    return sharpen(tiny_llama(vocab_size=24, num_layers=2, seed=3), 6.0)


@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.parametrize("strategy,options", [
    ("tetris", {}),
    ("tetris", {"tetris_budget": 2}),  # a partial budget: TETRIS ranks lookup cells across rows
    ("fixed", {}),
    ("adaptive", {"tetris_cost_profile": sampling.CHEAP_VERIFY}),
    ("dsd", {"tetris_cost_profile": sampling.CHEAP_VERIFY}),
])
def test_greedy_rows_equal_the_target_alone(repetitive_target, batch_size, strategy, options):
    prompts = repetitive_prompts(batch_size, 24, seed=batch_size)
    eos = pick_eos(repetitive_target, prompts) if batch_size > 1 else EOS  # some rows stop early
    references = target_alone(repetitive_target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    out = lookup_generate(repetitive_target, input_ids, mask, eos, prompt_lookup_num_tokens=3,
                          tetris_strategy=strategy, **options)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    stats = out.tetris_stats
    assert stats.emitted_tokens == sum(len(reference) for reference in references)
    if strategy != "adaptive":
        assert stats.accepted_tokens > 0  # lookup drafted, and was right at times
    assert stats.drafted_tokens < sum(stats.num_drafted_per_step) * batch_size or batch_size == 1


@pytest.mark.parametrize("options", [
    {"max_matching_ngram_size": 1},
    {"max_matching_ngram_size": 4, "tetris_min_ngram_size": 2},
    {"tetris_extra_tokens": 0, "prompt_lookup_num_tokens": 1},
])
def test_greedy_rows_equal_the_target_alone_for_other_ngram_settings(repetitive_target, options):
    prompts = repetitive_prompts(5, 24, seed=9)
    references = target_alone(repetitive_target, prompts, EOS)
    input_ids, mask = left_pad(prompts)
    out = lookup_generate(repetitive_target, input_ids, mask, EOS, **{"prompt_lookup_num_tokens": 4, **options})
    assert_rows_equal(out.sequences, input_ids, mask, references)


def test_rows_that_never_match_draft_nothing():
    """Prompts of distinct tokens and a target that never repeats a token within the call: no row ever matches."""
    target = tiny_llama(vocab_size=64, seed=4)
    prompts = [[3, 4, 5, 6], [10, 11, 12, 13]]  # no padding (a banned pad token would change the law per row)
    input_ids, mask = left_pad(prompts)
    target.generation_config.no_repeat_ngram_size = 1  # every token already in a row is banned: none repeats
    out = lookup_generate(target, input_ids, mask, EOS, prompt_lookup_num_tokens=3)
    references = target_alone(target, prompts, EOS)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    assert out.tetris_stats.drafted_tokens == 0 and out.tetris_stats.verified_tokens == 0


def sampled_model_free_joint(target, strategy, seed=0, **options):
    """12,000 rows of ``sampling.PROMPT`` drafted without a model (prompt lookup or suffix drafts, by ``options``), the
    first four sampled tokens counted: ``(counts, stats)``."""
    torch.manual_seed(seed)
    input_ids = torch.tensor([sampling.PROMPT] * sampling.ROWS)
    out = target.generate(input_ids, custom_generate="tetris", do_sample=True, temperature=1.0, top_k=0,
                          max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD, tetris_strategy=strategy,
                          return_dict_in_generate=True, **options)
    generated = torch.nn.functional.pad(out.sequences[:, len(sampling.PROMPT):],
                                        (0, 4 - (out.sequences.shape[1] - len(sampling.PROMPT))), value=PAD)
    counts = {}
    for row in generated.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, out.tetris_stats


LOOKUP_PROMPT = [3, 4, 5, 3, 4, 5, 3]  # its suffix matches: lookup drafts 4 5 3 ...


@pytest.fixture
def lookup_sampling(monkeypatch):
    monkeypatch.setattr(sampling, "PROMPT", LOOKUP_PROMPT)
    target = sharpen(tiny_llama(sampling.VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    return target, sampling.exact_joint(target, 1.0, 1.0, new_tokens=4)


@pytest.mark.parametrize("strategy,options", [
    ("tetris", {"prompt_lookup_num_tokens": 2, "tetris_extra_tokens": 1, "tetris_budget": sampling.ROWS}),
    ("fixed", {"prompt_lookup_num_tokens": 2}),
])
def test_sampled_sequences_follow_the_target_distribution(lookup_sampling, strategy, options):
    """The joint law of the first four tokens, with a partial budget (TETRIS verifies C = B of 3B cells)."""
    target, joint = lookup_sampling
    counts, stats = sampled_model_free_joint(target, strategy, **options)
    assert 0 < stats.accepted_tokens < stats.verified_tokens  # both branches taken
    if strategy == "tetris":
        assert stats.verified_tokens < stats.drafted_tokens  # selection left cells out
    assert sampling.chi_square_p_value(counts, joint) > 1e-3


def test_chi_square_catches_a_rejection_that_keeps_the_drafted_token(lookup_sampling, monkeypatch):
    """Teeth: after a rejected lookup draft, sampling from ``p`` (not ``p`` without the draft) is biased."""
    target, joint = lookup_sampling
    monkeypatch.setattr(verification, "residual_distribution", lambda target_probs, draft_probs: (target_probs, None))
    counts, _ = sampled_model_free_joint(target, "fixed", prompt_lookup_num_tokens=2)
    assert sampling.chi_square_p_value(counts, joint) < 1e-3


@pytest.mark.parametrize("options,message", [
    ({"prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens` must be >= 1"),
    ({"prompt_lookup_num_tokens": -2}, "prompt_lookup_num_tokens` must be >= 1"),
    ({"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 1, "tetris_min_ngram_size": 2}, "is above"),
    ({"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 0}, "max_matching_ngram_size` must be >= 1"),
    ({"prompt_lookup_num_tokens": 2, "num_assistant_tokens": 3}, "make them equal"),
    ({"prompt_lookup_num_tokens": 2, "tetris_draft_vocab": 10}, "not supported with prompt lookup"),
    ({"prompt_lookup_num_tokens": 2, "assistant_model": "DRAFT", "tetris_draft_vocab": 10},
     "not supported with prompt lookup"),
    ({"max_matching_ngram_size": 2}, "pass `prompt_lookup_num_tokens=` too"),
    ({"prompt_lookup_num_tokens": 2, "assistant_model": "DRAFT", "tetris_tree_width": 2}, "prompt lookup"),
    ({}, "needs a draft"),
])
def test_bad_lookup_settings_are_refused_before_any_forward(options, message, monkeypatch):
    target = tiny_llama(vocab_size=32)
    draft = noisy_copy(target, 0.1)
    options = {key: (draft if value == "DRAFT" else value) for key, value in options.items()}

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(target, "forward", no_forward)
    input_ids, mask = left_pad([[3, 4, 3, 4], [5, 6]])
    with pytest.raises((ValueError, TypeError), match=message):
        target.generate(input_ids, attention_mask=mask, custom_generate="tetris", max_new_tokens=4, **options)


def test_a_generation_config_can_ask_for_lookup(repetitive_target):
    """``prompt_lookup_num_tokens`` set on a ``GenerationConfig`` reaches the loop (transformers itself would refuse
    the batch: its own lookup serves one row)."""
    from transformers import GenerationConfig

    prompts = repetitive_prompts(4, 24, seed=2)
    input_ids, mask = left_pad(prompts)
    config = GenerationConfig(prompt_lookup_num_tokens=2, max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=EOS, pad_token_id=PAD)
    out = repetitive_target.generate(input_ids, attention_mask=mask, custom_generate="tetris",
                                     generation_config=config, return_dict_in_generate=True)
    assert_rows_equal(out.sequences, input_ids, mask, target_alone(repetitive_target, prompts, EOS))
    assert set(out.tetris_stats.num_drafted_per_step) <= {0, 2 + 2}  # k = 2, e = 2 (TETRIS's default)
    assert config.prompt_lookup_num_tokens == 2  # the caller's config is left as it was


@pytest.mark.parametrize("strategy", ["tetris", "fixed"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_lookup_step_reads_the_device_at_most_twice(repetitive_target, strategy, do_sample):
    """Lookup drafting itself reads nothing: a steady step makes the loop's reads only (see test_host_reads)."""
    from test_host_reads import host_reads

    input_ids, mask = left_pad(repetitive_prompts(8, 24, seed=5))
    with host_reads.HostReads() as reads:
        repetitive_target.generate(input_ids, attention_mask=mask, custom_generate="tetris", max_new_tokens=40,
                                   prompt_lookup_num_tokens=3, tetris_strategy=strategy, do_sample=do_sample,
                                   pad_token_id=PAD, tetris_step_callback=reads.step_done)
    steady = reads.per_step[2:-1]
    assert len(steady) >= 5
    assert max(steady) <= 2, reads.per_step


@pytest.mark.parametrize("option", ["prompt_lookup_num_tokens", "tetris_suffix_num_tokens"])
def test_adaptive_with_a_model_free_drafter_probes_first_at_its_third_step(option):
    """Two plain steps, then the first probe: rows that have just read their prompts have written nothing of their
    answers for lookup or suffix drafts to copy (a probe there learns that nothing is accepted)."""
    target = sharpen(tiny_llama(vocab_size=24, num_layers=2, seed=3), 6.0)
    input_ids, mask = left_pad(repetitive_prompts(3, 24, seed=1))
    steps = []
    lookup_generate(target, input_ids, mask, None, tetris_strategy="adaptive", **{option: 3},
                    tetris_cost_profile=sampling.CHEAP_VERIFY,
                    tetris_step_callback=lambda record, loop: steps.append((record.num_drafted, record.probe)))
    assert steps[:4] == [(0, False), (0, False), (0, False), (1, True)]  # (the first record: the prompts' read)
