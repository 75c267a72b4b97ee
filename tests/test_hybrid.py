"""Hybrid drafting (a draft model or EAGLE head with ``prompt_lookup_num_tokens``): greedy rows equal the target alone
whichever source drafted them, the model's cache stays what a fresh run would read after rows that verified lookup
cells, sampling follows the target's law, the model's confidences are calibrated against what it got accepted, the
stats by source add up, and a step reads the device no more than the loop's own reads."""

import copy
import itertools

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import test_sampling_distribution as sampling
from eagle_checkpoints import VOCAB as EAGLE_VOCAB
from tetris_hf.candidate_generators import BatchedDraftCandidateGenerator
from tetris_hf.candidate_generators.eagle_drafter import EagleCandidateGenerator
from tetris_hf.candidate_generators.hybrid import DraftAcceptance, HybridCandidateGenerator
from tetris_hf.step_strategy import DraftPlan
from tetris_hf.strategies import FixedWindow, TetrisSelection
from test_eagle_loop import accept_two_drafts, drafts_from_scratch, load_pair, record_proposals
from test_greedy_exactness import NEW_TOKENS, assert_rows_equal, pick_eos, target_alone
from test_prompt_lookup import repetitive_prompts
from tiny_models import EOS, PAD, left_pad, noisy_copy, random_prompts, sharpen, tiny_llama

VOCAB = 24
STRATEGIES = [
    ("tetris", {}),
    ("tetris", {"tetris_budget": 2}),  # a partial budget: lookup cells and model cells compete
    ("fixed", {}),
    ("adaptive", {"tetris_cost_profile": sampling.CHEAP_VERIFY}),
    ("dsd", {"tetris_cost_profile": sampling.CHEAP_VERIFY}),
]


@pytest.fixture(scope="module")
def pair():
    """A target peaked enough to repeat itself (lookup is often right) and a noisy copy of it (often right too)."""
    target = sharpen(tiny_llama(vocab_size=VOCAB, num_layers=2, seed=3), 6.0)
    return target, noisy_copy(target, 0.5)


def hybrid_generate(target, draft, input_ids, mask, eos, **options):
    options = {"max_new_tokens": NEW_TOKENS, **options}
    return target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                           do_sample=False, eos_token_id=eos, pad_token_id=PAD, return_dict_in_generate=True,
                           **options)


def exact_hybrid_run(target, draft, prompts: list[list[int]], **options):
    """A greedy hybrid call (``prompt_lookup_num_tokens=3``) on ``prompts``, EOS picked so that some rows stop early
    when there are several: every row equals the target alone; returns the call's stats."""
    eos = pick_eos(target, prompts) if len(prompts) > 1 else EOS
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    out = hybrid_generate(target, draft, input_ids, mask, eos, prompt_lookup_num_tokens=3, **options)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    assert out.tetris_stats.emitted_tokens == sum(len(reference) for reference in references)
    return out.tetris_stats


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("strategy,options", STRATEGIES)
def test_greedy_rows_equal_the_target_alone_draft_model(pair, batch_size, strategy, options):
    """Rows that repeat a motif (lookup matches), random ones (it matches only once the output repeats) and a
    one-token row."""
    target, draft = pair
    stats = exact_hybrid_run(target, draft, repetitive_prompts(batch_size, VOCAB, seed=batch_size),
                             tetris_strategy=strategy, **options)
    if batch_size > 1 and strategy in ("tetris", "fixed"):  # both sources drafted, and drafts were right at times
        assert stats.lookup_drafted_tokens > 0 and stats.model_drafted_tokens > 0 and stats.accepted_tokens > 0


def test_rows_that_never_match_draft_with_the_model():
    """Distinct prompt tokens and a target banned from repeating any: lookup never matches, the model drafts all."""
    target = tiny_llama(vocab_size=64, seed=4)
    draft = noisy_copy(target, 0.2)
    prompts = [[3, 4, 5, 6], [10, 11, 12, 13]]
    input_ids, mask = left_pad(prompts)
    target.generation_config.no_repeat_ngram_size = 1
    references = target_alone(target, prompts, EOS)
    out = hybrid_generate(target, draft, input_ids, mask, EOS, prompt_lookup_num_tokens=3)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    stats = out.tetris_stats
    assert stats.lookup_drafted_tokens == 0 and stats.model_drafted_tokens == stats.drafted_tokens > 0


@pytest.fixture(scope="module")
def eagle_pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads")
    return {name: load_pair(folder, family, name) for family, name in (("llama", "eagle1"), ("qwen2", "eagle3"))}


def eagle_prompts(batch_size: int, seed: int) -> list[list[int]]:
    """Every other row repeats a motif (lookup matches), the rest are random."""
    prompts = [[3 + token for token in row] for row in random_prompts(batch_size, EAGLE_VOCAB - 3, seed, 1, 9)]
    for row in range(0, batch_size, 2):
        prompts[row] = (prompts[row][:2] * 4)[: 2 + 2 * (row % 4)] or prompts[row]
    return prompts


@pytest.mark.parametrize("head_format,batch_size", [("eagle1", 1), ("eagle3", 3), ("eagle1", 8), ("eagle3", 8)])
@pytest.mark.parametrize("strategy,options", STRATEGIES)
def test_greedy_rows_equal_the_target_alone_eagle(eagle_pairs, head_format, batch_size, strategy, options):
    target, head = eagle_pairs[head_format]
    stats = exact_hybrid_run(target, head, eagle_prompts(batch_size, seed=batch_size), tetris_strategy=strategy,
                             **options)
    if batch_size > 1 and strategy in ("tetris", "fixed"):  # (the cost-aware ones may decode plainly)
        assert stats.lookup_drafted_tokens > 0 and stats.model_drafted_tokens > 0, stats


@torch.no_grad()
def draft_from_scratch(draft, context: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The draft model on one row alone, no padding, no cache: its greedy continuation and ``log max q``."""
    ids, log_q = torch.tensor([context]), []
    for _ in range(num_tokens):
        scores = draft(ids).logits[0, -1].double().log_softmax(-1)
        log_q.append(scores.max())
        ids = torch.cat([ids, scores.argmax()[None, None]], dim=1)
    return ids[0, len(context):].tolist(), torch.stack(log_q)


def from_scratch_case(pair, eagle_pairs, kind: str):
    """``(target, draft, prompts, drafter class)`` for the from-scratch tests: the draft model in float64, or an EAGLE
    head of ``kind``."""
    if kind == "draft":
        target, draft = (copy.deepcopy(model).double() for model in pair)
        return target, draft, repetitive_prompts(5, VOCAB, seed=4), BatchedDraftCandidateGenerator
    target, head = eagle_pairs[kind]
    return target, head, eagle_prompts(5, seed=4), EagleCandidateGenerator


def fixed_hybrid_call(target, draft, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    """A greedy ``fixed`` hybrid call with no EOS and the model's ``log q`` drafted (a step callback asks for them);
    returns the prompts' mask."""
    input_ids, mask = left_pad(prompts)
    target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris", do_sample=False,
                    max_new_tokens=max_new_tokens, pad_token_id=PAD, eos_token_id=None, prompt_lookup_num_tokens=3,
                    tetris_extra_tokens=0, tetris_strategy="fixed", tetris_step_callback=lambda record, loop: None)
    return mask


def assert_proposals_from_scratch(kind: str, target, draft, proposals: list, mask: torch.Tensor) -> None:
    """Every recorded model proposal (``record_proposals``) equals the model run afresh on its row's context: tokens
    and ``log max q``."""
    starts = (mask == 0).sum(dim=1)
    for tokens, log_q, context, lengths, rows in proposals:
        for row in range(tokens.shape[0]):
            row_context = context[row, int(starts[rows[row]]) : int(lengths[row])].tolist()
            if kind == "draft":
                expected, expected_log_q = draft_from_scratch(draft, row_context, tokens.shape[1])
            else:
                expected, expected_log_q = drafts_from_scratch(target, draft, row_context, tokens.shape[1])
            assert tokens[row].tolist() == expected, (row, row_context)
            torch.testing.assert_close(log_q[row].double(), expected_log_q.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["draft", "eagle1", "eagle3"])
def test_every_model_proposal_equals_the_model_run_from_scratch(pair, eagle_pairs, monkeypatch, kind):
    """After rows that verified lookup cells (accepted or not), plain steps and model rows, the model's cache and
    pending tokens hold each row's context exactly: every row's model drafts equal the model run afresh on it. The
    verifier accepts every row's first two verified cells, so lookup rows accept cells the model never drafted."""
    target, draft, prompts, drafter_class = from_scratch_case(pair, eagle_pairs, kind)
    proposals = record_proposals(monkeypatch, drafter_class)
    chosen = record_proposals(monkeypatch, HybridCandidateGenerator)  # what each row verified
    accept_two_drafts(monkeypatch)
    mask = fixed_hybrid_call(target, draft, prompts, max_new_tokens=14)
    # rows that accepted a lookup cell the model had drafted otherwise (the model must read it), and model rows
    foreign = sum(int((hybrid[:, :1] != model[:, :1]).any(dim=1).sum()) for (hybrid, *_), (model, *_)
                  in zip(chosen, proposals))
    own = sum(int((hybrid == model).all(dim=1).sum()) for (hybrid, *_), (model, *_) in zip(chosen, proposals))
    assert foreign >= 3 and own >= 3, (foreign, own)
    assert len(proposals) >= 4
    assert_proposals_from_scratch(kind, target, draft, proposals, mask)


def test_accept_cells_keeps_own_drafts_and_queues_foreign_ones(pair):
    """The docstring's example: K = 3, an own row accepting 1 of its drafts and a foreign row accepting 2 lookup cells
    (hand-built verdict): the cache keeps ``[p | d1 .]`` and ``[r | . .]``, pending is ``[. . t]`` and ``[x1 x2 u]``."""
    from transformers.generation.logits_process import LogitsProcessorList

    from tetris_hf.logits import PositionwiseLogitsProcessor
    from tetris_hf.step import ReadHints, Verdict

    _, draft = pair
    drafter = BatchedDraftCandidateGenerator(draft, PositionwiseLogitsProcessor(LogitsProcessorList()), False)
    prompts = torch.tensor([[5, 6], [7, 8]])
    drafter.prefill(prompts, torch.ones_like(prompts), all_real=True)
    sequences = torch.cat([prompts, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    drafts = drafter.propose(sequences, torch.tensor([2, 2]), 3).tokens
    first_draft_slot = drafter.slots.length - 2
    cells = torch.stack([drafts[0], torch.tensor([20, 21, 22])])  # row 1 verified lookup's x1 x2 x3
    verdict = Verdict(torch.tensor([1, 2]), torch.tensor([11, 12]), torch.tensor([3, 3]),
                      hints=ReadHints(max_accepted=2, cached_longest=None))
    drafter.accept_cells(verdict, cells, torch.tensor([False, True]))
    assert drafter.slots.slot_mask[:, first_draft_slot:drafter.slots.length].tolist() == [[True, False],
                                                                                         [False, False]]
    assert (drafter.pending_tokens * drafter.pending_mask).tolist() == [[0, 0, 11], [20, 21, 12]]
    assert drafter.pending_mask.tolist() == [[0, 0, 1], [1, 1, 1]]


def test_the_stats_by_source_add_up(pair):
    """Per step, a lookup row drafted its match's cells and a model row ``K``; the totals by source are the sums of
    the steps' rows, and lookup's and the model's make the call's totals."""
    target, draft = pair
    prompts = repetitive_prompts(8, VOCAB, seed=2)
    input_ids, mask = left_pad(prompts)
    records = []
    out = hybrid_generate(target, draft, input_ids, mask, EOS, prompt_lookup_num_tokens=3, tetris_budget=6,
                          tetris_step_callback=lambda record, loop: records.append(record))
    stats = out.tetris_stats
    drafted = [(record.drafted_lengths, record.by_lookup.bool()) for record in records]
    lookup = [int(lengths[rows].sum()) for lengths, rows in drafted]
    assert stats.lookup_drafted_per_step == lookup
    assert stats.lookup_accepted_per_step == [int(record.num_accepted[record.by_lookup.bool()].sum())
                                              for record in records]
    assert stats.lookup_drafted_tokens == sum(lookup) > 0 and stats.model_drafted_tokens > 0
    for record in records[1:]:
        if record.num_drafted:  # model rows drafted K, lookup rows at most K
            assert (record.drafted_lengths[~record.by_lookup.bool()] == record.num_drafted).all()
            assert (record.drafted_lengths[record.by_lookup.bool()] <= record.num_drafted).all()
    for source in ("lookup", "model"):
        drafted_, verified, accepted = (getattr(stats, f"{source}_{name}_tokens")
                                        for name in ("drafted", "verified", "accepted"))
        assert 0 < accepted <= verified <= drafted_
    assert stats.lookup_verified_tokens + stats.model_verified_tokens == stats.verified_tokens
    assert stats.lookup_accepted_tokens + stats.model_accepted_tokens == stats.accepted_tokens
    alone = hybrid_generate(target, draft, input_ids, mask, EOS).tetris_stats  # a draft model alone: no lookup
    assert alone.lookup_drafted_tokens == alone.lookup_accepted_tokens == 0 and alone.drafted_tokens > 0
    lookup_alone = target.generate(input_ids, attention_mask=mask, custom_generate="tetris", do_sample=False,
                                   max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD,
                                   prompt_lookup_num_tokens=3, return_dict_in_generate=True).tetris_stats
    assert lookup_alone.lookup_drafted_tokens == lookup_alone.drafted_tokens > 0
    assert lookup_alone.model_accepted_tokens == 0


def test_an_overconfident_draft_is_calibrated_down():
    """The calibration alone: cells drafted at ``max q = 0.95`` of which 30% are accepted (the rest rejected) bring
    the top bin to about 0.3, and cells never reached change nothing."""
    calibration = DraftAcceptance(torch.device("cpu"))
    sure = torch.full((10, 2), 0.95).log()
    before = calibration.log_probs(sure[:1, :1]).exp().item()
    accepted = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    for _ in range(100):  # each row verifies 2 cells: cell 0 accepted in 3 rows, then cell 1 rejected there
        calibration.update(sure, torch.full((10,), 2), accepted, torch.ones(10, dtype=torch.bool))
    after = calibration.log_probs(sure[:1, :1]).exp().item()
    assert before == pytest.approx(0.95) and after == pytest.approx(3 / 13, abs=0.03)  # 3 accepted of 13 reached
    assert calibration.log_probs(torch.tensor([[0.15]]).log()).exp().item() == pytest.approx(0.15)  # untouched bin
    rows_off = DraftAcceptance(torch.device("cpu"))
    rows_off.update(sure, torch.full((10,), 2), accepted, torch.zeros(10, dtype=torch.bool))  # lookup rows: ignored
    assert rows_off.log_probs(sure[:1, :1]).exp().item() == pytest.approx(0.95)


def test_an_overconfident_draft_model_is_calibrated_down_in_the_loop():
    """A draft sure of itself (a random model, its head scaled up: ``max q`` near 1) and mostly wrong: every bin of
    ``max q`` its verified cells fell in ends well below its centre, near what the model got accepted, so TETRIS no
    longer ranks its cells as sure ones."""
    target = sharpen(tiny_llama(vocab_size=VOCAB, num_layers=2, seed=3), 6.0)
    draft = sharpen(tiny_llama(vocab_size=VOCAB, num_layers=1, seed=9), 200.0)
    input_ids, mask = left_pad(repetitive_prompts(8, VOCAB, seed=5))
    loops = []
    out = hybrid_generate(target, draft, input_ids, mask, None, prompt_lookup_num_tokens=3, tetris_budget=16,
                          max_new_tokens=40, tetris_step_callback=lambda record, loop: loops.append(loop))
    stats = out.tetris_stats
    assert stats.model_verified_tokens > 20 and stats.model_accepted_tokens < 0.3 * stats.model_verified_tokens
    calibration = loops[-1].drafter.calibration
    reached = calibration.tried > 3
    assert reached[-1]  # the top bin: max q above 0.9
    rates = calibration.rates()
    assert rates[-1] < 0.4 and (rates[reached] < calibration.prior[reached] - 0.2).all(), rates


def sampled_hybrid_joint(target, draft, seed=0, **options):
    torch.manual_seed(seed)
    input_ids = torch.tensor([sampling.PROMPT] * sampling.ROWS)
    out = target.generate(input_ids, assistant_model=draft, custom_generate="tetris", do_sample=True,
                          temperature=1.0, top_k=0, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD,
                          return_dict_in_generate=True, **options)
    generated = torch.nn.functional.pad(out.sequences[:, len(sampling.PROMPT):],
                                        (0, 4 - (out.sequences.shape[1] - len(sampling.PROMPT))), value=PAD)
    counts = {}
    for row in generated.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, out.tetris_stats


HYBRID_PROMPT = [3, 4, 5, 3, 4, 2]  # no match at first (2 is new); rows that then draw 3, 4 or 5 match


@pytest.fixture
def hybrid_sampling(monkeypatch):
    monkeypatch.setattr(sampling, "PROMPT", HYBRID_PROMPT)
    target = sharpen(tiny_llama(sampling.VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(sampling.VOCAB, num_layers=1, seed=22, hidden_size=16), 12)
    return target, draft, sampling.exact_joint(target, 1.0, 1.0, new_tokens=4)


SAMPLED = {"prompt_lookup_num_tokens": 1, "tetris_extra_tokens": 1, "tetris_budget": sampling.ROWS}


@pytest.mark.parametrize("strategy", ["tetris", "adaptive"])
def test_sampled_sequences_follow_the_target_distribution(hybrid_sampling, strategy):
    """The joint law of the first four tokens, with a partial budget (C = B of 2B cells) over rows drafted by both
    sources."""
    target, draft, joint = hybrid_sampling
    options = {**SAMPLED, "tetris_cost_profile": sampling.CHEAP_VERIFY} if strategy == "adaptive" else SAMPLED
    counts, stats = sampled_hybrid_joint(target, draft, tetris_strategy=strategy, **options)
    assert 0 < stats.lookup_accepted_tokens < stats.lookup_verified_tokens  # both branches, both sources
    assert 0 < stats.model_accepted_tokens < stats.model_verified_tokens
    assert stats.verified_tokens < stats.drafted_tokens  # selection left cells out
    assert sampling.chi_square_p_value(counts, joint) > 1e-3


def test_sampled_sequences_follow_the_target_distribution_when_lookup_drafts_alone(hybrid_sampling, monkeypatch):
    """As above with every other drafting step by lookup alone (rows without a match verify nothing there)."""
    target, draft, joint = hybrid_sampling
    calls = lookup_alone_on(monkeypatch, TetrisSelection, pattern=(False, True))
    counts, stats = sampled_hybrid_joint(target, draft, tetris_strategy="tetris", **SAMPLED)
    assert len(calls) > 0 and 0 < stats.lookup_accepted_tokens < stats.lookup_verified_tokens
    assert 0 < stats.model_accepted_tokens < stats.model_verified_tokens
    assert sampling.chi_square_p_value(counts, joint) > 1e-3


def test_chi_square_catches_lookup_rows_verified_against_the_models_q(hybrid_sampling, monkeypatch):
    """Teeth: a lookup row's ``q`` is one-hot at its draft; verifying it against the model's distribution (``q`` not
    mixed per row) is biased."""
    target, draft, joint = hybrid_sampling
    model_probs = []
    real_model_propose, real_propose = BatchedDraftCandidateGenerator.propose, HybridCandidateGenerator.propose

    def keeping_the_models_q(self, *args, **kwargs):
        proposal = real_model_propose(self, *args, **kwargs)
        model_probs.append(proposal.probs)
        return proposal

    def unmixed(self, *args, **kwargs):
        proposal = real_propose(self, *args, **kwargs)
        return proposal if proposal.probs is None else proposal._replace(probs=model_probs[-1])

    monkeypatch.setattr(BatchedDraftCandidateGenerator, "propose", keeping_the_models_q)
    monkeypatch.setattr(HybridCandidateGenerator, "propose", unmixed)
    counts, _ = sampled_hybrid_joint(target, draft, tetris_strategy="fixed", prompt_lookup_num_tokens=2)
    assert sampling.chi_square_p_value(counts, joint) < 1e-3


@pytest.mark.parametrize("strategy", ["tetris", "fixed"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_hybrid_step_reads_the_device_at_most_twice(pair, strategy, do_sample):
    """Choosing a source per row, mixing ``q`` and calibrating read nothing: a steady step makes the loop's reads
    only (see test_host_reads)."""
    from test_host_reads import host_reads

    target, draft = pair
    input_ids, mask = left_pad(repetitive_prompts(8, VOCAB, seed=5))
    with host_reads.HostReads() as reads:
        target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                        max_new_tokens=40, prompt_lookup_num_tokens=3, tetris_strategy=strategy, do_sample=do_sample,
                        pad_token_id=PAD, tetris_step_callback=reads.step_done)
    steady = reads.per_step[2:-1]
    assert len(steady) >= 5
    assert max(steady) <= 2, reads.per_step


@pytest.mark.parametrize("strategy", ["tetris", "fixed", "adaptive", "dsd"])
@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_stream_rows_equal_target_alone_hybrid(pair, strategy, max_batch_size):
    """The request stream with hybrid drafting: rows join mid-stream (both parts take them) and each request's output
    is the target's own."""
    from tetris_hf.stream import RequestStream
    from test_stream import check_exact, requests

    target, draft = pair
    stream = RequestStream(target, assistant_model=draft, max_batch_size=max_batch_size, prefill_chunk=5,
                           eos_token_id=None, tetris_strategy=strategy, prompt_lookup_num_tokens=3)
    check_exact(target, stream, requests(target, 8, seed=20 + max_batch_size, max_prompt=16))


def test_hybrid_with_trees_or_a_draft_vocab_is_refused(pair):
    target, draft = pair
    input_ids, mask = left_pad([[3, 4, 3, 4]])
    for options, message in (({"tetris_tree_width": 2}, "prompt lookup"),
                             ({"tetris_draft_vocab": 10}, "not supported with prompt lookup")):
        with pytest.raises(ValueError, match=message):
            target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                            max_new_tokens=3, prompt_lookup_num_tokens=2, **options)


# -- steps where prompt lookup drafts alone (adaptive plans them where the model's forwards do not pay) ------------


def lookup_alone_on(monkeypatch, strategy_class=None, pattern=(False, True, True)) -> list:
    """Plans of ``strategy_class`` draft by lookup alone on the drafting steps ``pattern`` marks (cycled; no class:
    plans as they are); returns the row counts of ``propose(..., lookup_only=True)`` calls, filled as the loop runs."""
    real_plan = None if strategy_class is None else strategy_class.plan
    real_propose = HybridCandidateGenerator.propose
    steps, calls = itertools.count(), []

    def plan(self, num_rows):
        planned = real_plan(self, num_rows)
        return planned._replace(lookup_only=pattern[next(steps) % len(pattern)] and planned.num_draft_tokens > 0)

    def propose(self, sequences, lengths, num_tokens, rows=None, confidences=True, *, lookup_only=False, **options):
        if lookup_only:
            calls.append(sequences.shape[0])
        return real_propose(self, sequences, lengths, num_tokens, rows, confidences, lookup_only=lookup_only,
                            **options)

    if strategy_class is not None:
        monkeypatch.setattr(strategy_class, "plan", plan)
    monkeypatch.setattr(HybridCandidateGenerator, "propose", propose)
    return calls


@pytest.mark.parametrize("kind,batch_size", [("draft", 1), ("draft", 3), ("draft", 8), ("eagle1", 3), ("eagle3", 8)])
@pytest.mark.parametrize("strategy,options", STRATEGIES[:3])
def test_greedy_rows_equal_the_target_alone_when_lookup_drafts_alone(pair, eagle_pairs, monkeypatch, kind,
                                                                     batch_size, strategy, options):
    """Steps drafting by lookup alone between steps with both: the model reads what those steps made final (lookup's
    accepted cells, the target's tokens) at its next proposal."""
    strategy_class = TetrisSelection if strategy == "tetris" else FixedWindow
    calls = lookup_alone_on(monkeypatch, strategy_class)
    if kind == "draft":
        target, draft = pair
        prompts = repetitive_prompts(batch_size, VOCAB, seed=batch_size)
    else:
        target, draft = eagle_pairs[kind]
        prompts = eagle_prompts(batch_size, seed=batch_size)
    stats = exact_hybrid_run(target, draft, prompts, tetris_strategy=strategy, **options)
    assert len(calls) >= 2 and stats.model_drafted_tokens > 0


@pytest.mark.parametrize("kind", ["draft", "eagle3"])
def test_after_lookup_alone_steps_model_proposals_equal_the_model_run_from_scratch(pair, eagle_pairs, monkeypatch,
                                                                                   kind):
    """As the test above it, with two of every three drafting steps by lookup alone: the cells they accepted (two a
    row, the verifier says) and the target's tokens wait for the model, which drafts from exactly each row's context."""
    target, draft, prompts, drafter_class = from_scratch_case(pair, eagle_pairs, kind)
    calls = lookup_alone_on(monkeypatch, FixedWindow)
    proposals = record_proposals(monkeypatch, drafter_class)
    accept_two_drafts(monkeypatch)
    mask = fixed_hybrid_call(target, draft, prompts, max_new_tokens=30)
    assert len(calls) >= 4 and len(proposals) >= 3
    assert_proposals_from_scratch(kind, target, draft, proposals, mask)


def test_queued_cells_are_left_packed_after_what_waits(pair):
    """A model that drafted nothing this step (lookup alone did) queues ``[accepted cells, t]`` after its pending
    tokens, left-packed: pending ``[. p]`` and ``[q r]``, rows accepting 2 and 0 cells -> ``[. p x1 x2 t]`` and
    ``[. . q r u]``."""
    from transformers.generation.logits_process import LogitsProcessorList

    from tetris_hf.logits import PositionwiseLogitsProcessor
    from tetris_hf.step import ReadHints, Verdict

    _, draft = pair
    drafter = BatchedDraftCandidateGenerator(draft, PositionwiseLogitsProcessor(LogitsProcessorList()), False)
    drafter.prefill(torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]]))
    sequences = torch.zeros(2, 8, dtype=torch.long)
    assert drafter.propose(sequences, torch.tensor([2, 2]), 0).tokens.shape == (2, 0)
    verdict = Verdict(torch.tensor([2, 0]), torch.tensor([11, 12]), torch.tensor([3, 1]),
                      hints=ReadHints(max_accepted=2, cached_longest=None))
    drafter.accept_cells(verdict, torch.tensor([[20, 21, 22], [23, 0, 0]]), torch.tensor([True, False]))
    assert drafter.pending_mask.tolist() == [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert (drafter.pending_tokens * drafter.pending_mask).tolist() == [[0, 5, 20, 21, 11], [0, 0, 6, 7, 12]]
    assert not drafter.pending_real and drafter.pending_count is None  # (counted at the loop's next read)


def test_adaptive_drafts_by_lookup_alone_where_the_model_does_not_pay():
    """The plan compares a step with both sources (the model's forwards priced) and one by lookup alone (free): a
    costly model whose rows are rarely accepted is left out, a cheap and often-right one is not."""
    from tetris_hf.cost_model import CostProfile, StepCostModel
    from tetris_hf.options import TetrisOptions
    from tetris_hf.strategies import LOOKUP_ROW, MODEL_ROW, AdaptiveBudget

    def planned(draft_ms: float, model_acceptance: float) -> DraftPlan:
        rows = (1, 4, 16, 64)
        cost = CostProfile({(r, t): 10.0 + 0.5 * r * t for r in rows for t in (1, 2, 4, 8)}, {r: draft_ms for r in rows})
        strategy = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive", num_assistant_tokens=3,
                                                tetris_extra_tokens=0), StepCostModel(cost), hybrid=True)
        # half the rows matched (lookup cells accepted 0.9 of the time), half the model drafted
        strategy.calibrator.update_cells(torch.full((2000,), 0.9), torch.rand(2000) < 0.9)
        strategy.calibrator.update_cells(torch.full((2000,), 0.2), torch.rand(2000) < model_acceptance)
        log_q = torch.tensor([[0.9] * 3, [0.2] * 3] * 32).log()
        strategy.remember(log_q, torch.tensor([LOOKUP_ROW, MODEL_ROW] * 32))
        strategy.memory.plain_streak = 0
        return strategy.plan(8)

    costly = planned(draft_ms=30.0, model_acceptance=0.2)
    assert costly.lookup_only and costly.num_draft_tokens > 0 and not costly.probe
    cheap = planned(draft_ms=0.01, model_acceptance=0.9)
    assert not cheap.lookup_only and cheap.num_draft_tokens > 0


def test_adaptive_hybrid_learns_to_draft_by_lookup_alone_in_the_loop(pair, monkeypatch):
    """A draft model priced far above the target and rarely right beside lookup on repetitive rows: ``adaptive``
    drafts by lookup alone on most steps, and the rows stay exact."""
    import test_greedy_exactness

    from tetris_hf.cost_model import CostProfile

    monkeypatch.setattr(test_greedy_exactness, "NEW_TOKENS", 60)  # (long enough for the probes to find lookup's rows)

    target, _ = pair
    draft = noisy_copy(target, 3.0, seed=9)  # rarely agrees with the target
    rows = (1, 4, 16, 64)
    costly_draft = CostProfile({(r, t): 10.0 + 0.1 * r * t for r in rows for t in (1, 2, 4, 8)}, {r: 40.0 for r in rows})
    prompts = repetitive_prompts(6, VOCAB, seed=6)
    references = target_alone(target, prompts, EOS)
    input_ids, mask = left_pad(prompts)
    steps = []
    out = hybrid_generate(target, draft, input_ids, mask, EOS, prompt_lookup_num_tokens=3, tetris_strategy="adaptive",
                          tetris_cost_profile=costly_draft, max_new_tokens=60,
                          tetris_step_callback=lambda record, loop: steps.append(record))
    assert_rows_equal(out.sequences, input_ids, mask, references)
    stats = out.tetris_stats
    assert stats.lookup_accepted_tokens > 0
    assert stats.model_drafted_tokens < stats.lookup_drafted_tokens / 2, stats


def test_adaptive_steps_by_lookup_alone_read_the_device_as_its_other_steps(pair, monkeypatch):
    """Choosing lookup alone, and learning which source drafted each row, adds no device read: a steady step of a
    hybrid ``adaptive`` run reads what other ``adaptive`` steps read (the strategy's one transfer, the loop's)."""
    from test_host_reads import count_strategy_transfers, host_reads

    from tetris_hf.cost_model import CostProfile
    from tetris_hf.pair_memory import pair_memory

    target, draft = pair
    rows = (1, 4, 16, 64)
    costly_draft = CostProfile({(r, t): 10.0 + 0.1 * r * t for r in rows for t in (1, 2, 4, 8)}, {r: 40.0 for r in rows})
    input_ids, mask = left_pad(repetitive_prompts(8, VOCAB, seed=5))
    calls = lookup_alone_on(monkeypatch)
    pair_memory(target, draft, hybrid=True).guarded = False  # (an earlier test's guard verdict on the pair: lifted)
    with host_reads.HostReads(host_files=("strategies.py", "goodput.py", "cost_model.py")) as reads:
        count_strategy_transfers(monkeypatch, reads)
        target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                        max_new_tokens=40, prompt_lookup_num_tokens=3, tetris_strategy="adaptive",
                        tetris_cost_profile=costly_draft, pad_token_id=PAD, tetris_step_callback=reads.step_done)
    steady = reads.per_step[3:-1]
    assert len(calls) >= 5 and len(steady) >= 5
    assert max(steady) <= 3, reads.per_step


@pytest.mark.parametrize("kind", ["draft", "eagle3"])
def test_stream_rows_equal_target_alone_when_lookup_drafts_alone(pair, eagle_pairs, monkeypatch, kind):
    """The request stream with two of every three drafting steps by lookup alone: rows joining between them (their
    prompts read by both parts) and rows whose model waits on lookup's accepted cells stay exact."""
    from tetris_hf.stream import RequestStream
    from test_stream import check_exact, requests

    target, draft = pair if kind == "draft" else eagle_pairs[kind]
    calls = lookup_alone_on(monkeypatch, TetrisSelection)
    stream = RequestStream(target, assistant_model=draft, max_batch_size=3, prefill_chunk=5, eos_token_id=None,
                           tetris_strategy="tetris", prompt_lookup_num_tokens=3)
    check_exact(target, stream, requests(target, 8, seed=31, max_prompt=16))
    assert len(calls) >= 4


def test_steps_by_lookup_alone_run_no_model_forward(pair, monkeypatch):
    """Every drafting step by lookup alone: the draft model never runs (no proposal, no catch-up of what waits), and
    the rows are the target's own."""
    target, draft = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    forwards = []
    draft.register_forward_hook(lambda *_: forwards.append(1))
    calls = lookup_alone_on(monkeypatch, TetrisSelection, pattern=(True,))
    prompts = repetitive_prompts(3, VOCAB, seed=3)
    references = target_alone(target, prompts, EOS)
    input_ids, mask = left_pad(prompts)
    out = hybrid_generate(target, draft, input_ids, mask, EOS, prompt_lookup_num_tokens=3)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    assert len(calls) >= 5 and forwards == [] and out.tetris_stats.lookup_accepted_tokens > 0
