"""The goodput optimiser behind ``adaptive`` and ``dsd``, their learning rules, and their greedy exactness."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf import cost_model
from tetris_hf.cost_model import CostProfile, StepCostModel
from tetris_hf.goodput import best_budget, dsd_window, expected_tokens_geometric, plan_step
from tetris_hf.options import TetrisOptions
from tetris_hf.selection import select_fixed_budget
from tetris_hf.strategies import AdaptiveBudget, DynamicWindow, make_strategy
from tetris_hf.step import run_step
from tetris_hf.step_strategy import DraftPlan, StepSeconds
from tetris_hf.tools.simulate import ReplayStep
from test_greedy_exactness import generate_checked, pick_eos, target_alone
from tiny_models import target_and_draft, PAD, left_pad, noisy_copy, random_prompts, tiny_llama

ROWS, TOKENS = (1, 4, 16, 64), (1, 2, 4, 8)


def profile(target_ms, draft_ms: float) -> CostProfile:
    return CostProfile({(r, t): target_ms(r, t) for r in ROWS for t in TOKENS}, {r: draft_ms for r in ROWS})


FREE_VERIFY = profile(lambda r, t: 10.0, 1e-3)  # verifying more tokens costs nothing, drafting almost nothing
COSTLY_VERIFY = profile(lambda r, t: 10.0 * r * t, 2.0)  # every verified token costs a full token's forward


def test_optimiser_picks_no_drafting_when_verification_is_expensive_and_acceptance_low():
    cost = StepCostModel(COSTLY_VERIFY)
    survival = torch.full((8, 6), 0.1).cumprod(dim=1)
    choice = best_budget(survival, torch.full((8,), 6), 6 * cost.draft_seconds(8), cost.verify_seconds_by_length(8, 6))
    assert int(choice.budget) == 0
    plan = plan_step(torch.full((32, 6), 0.1), 8, 6, cost)
    assert (plan.num_draft_tokens, plan.budget) == (0, 0)


def test_optimiser_picks_the_largest_budget_when_verification_is_free_and_acceptance_high():
    cost = StepCostModel(FREE_VERIFY)
    survival = torch.full((8, 6), 0.9).cumprod(dim=1)
    choice = best_budget(survival, torch.full((8,), 6), 6 * cost.draft_seconds(8), cost.verify_seconds_by_length(8, 6))
    assert int(choice.budget) == 8 * 6
    plan = plan_step(torch.full((32, 6), 0.9), 8, 6, cost)
    assert (plan.num_draft_tokens, plan.budget) == (6, 48)
    assert plan_step(torch.full((32, 6), 0.9), 8, 6, cost, max_budget=20).budget == 20


def test_best_budget_equals_brute_force_over_every_budget():
    generator = torch.Generator().manual_seed(3)
    for trial in range(30):
        rows, cells = (int(n) for n in torch.randint(1, 5, (2,), generator=generator))
        survival = torch.rand(rows, cells, generator=generator).cumprod(dim=1)
        max_lengths = torch.randint(0, cells + 1, (rows,), generator=generator)
        verify = torch.rand(cells + 1, generator=generator).double().cumsum(0) * (trial % 3)
        fixed = 0.5
        choice = best_budget(survival, max_lengths, fixed, verify)
        best_rate, best_c = -1.0, None
        candidates = [(i, j) for i in range(rows) for j in range(cells) if j < max_lengths[i]]
        for c in range(len(candidates) + 1):  # TETRIS order: survival descending, then row, then position
            chosen = sorted(candidates, key=lambda ij: (-float(survival[ij]), ij))[:c]
            tokens = rows + sum(float(survival[ij]) for ij in chosen)
            depth = max((j + 1 for _, j in chosen), default=0)
            rate = tokens / (fixed + float(verify[depth]))
            if rate > best_rate + 1e-12:
                best_rate, best_c = rate, c
        assert int(choice.budget) == best_c
        assert float(choice.tokens / choice.seconds) == pytest.approx(best_rate)


def test_dsd_window_follows_cost_and_acceptance():
    assert dsd_window(0.1, 8, 6, StepCostModel(COSTLY_VERIFY)) == 0
    assert dsd_window(0.95, 8, 6, StepCostModel(FREE_VERIFY)) == 6
    assert expected_tokens_geometric(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_geometric(1.0, 3) == 4


def test_dsd_acceptance_is_an_exponential_average_of_the_geometric_rate():
    strategy = DynamicWindow(TetrisOptions(tetris_strategy="dsd"), StepCostModel(FREE_VERIFY))
    assert strategy.plan(4) == DraftPlan(1, 4, probe=True, needs_confidences=False)  # no estimate yet: probe, k = 1
    lengths = torch.tensor([1, 1, 1, 1])
    strategy.observe(torch.zeros(4, 1), lengths, torch.tensor([1, 1, 1, 0]))  # 3 accepted, 1 rejection
    strategy.plan(4)  # what was observed is learnt before the next plan
    assert strategy.acceptance == pytest.approx(0.75)
    strategy.observe(torch.zeros(4, 2), torch.full((4,), 2), torch.tensor([2, 2, 0, 1]))  # 5 accepted, 2 rejections
    plan = strategy.plan(4)
    assert strategy.acceptance == pytest.approx(0.85 * 0.75 + 0.15 * 5 / 7)
    assert plan.budget == 4 * plan.num_draft_tokens == 4 * 6  # free verification: the longest k


@pytest.mark.parametrize("learn_costs", [True, False])
def test_cost_model_follows_the_loops_measured_step_times(learn_costs):
    cost = StepCostModel(profile(lambda r, t: 10.0 + r * t, 0.5))
    draft_two, verify_three = 2 * cost.draft_seconds(4), cost.verify_seconds(4, 3)  # 2 drafts, longest verifies 2
    strategy = DynamicWindow(TetrisOptions(tetris_strategy="dsd"), cost, learn_costs=learn_costs)
    for _ in range(40):  # this machine drafts 2x and verifies 3x slower than profiled, and spends 4 ms elsewhere
        strategy.observe(torch.zeros(4, 2), torch.full((4,), 2), torch.ones(4, dtype=torch.long),
                         StepSeconds(draft=2 * draft_two, verify=3 * verify_three, other=0.004))
    strategy.plan(4)  # learns what it observed
    scales = (cost.draft_scale, cost.target_scale, cost.step_overhead)
    expected = (pytest.approx(2.0), pytest.approx(3.0), pytest.approx(0.004)) if learn_costs else (1.0, 1.0, 0.0)
    assert scales == expected


class ScriptedRows:
    """Recorded rows (for :class:`~tetris_hf.tools.simulate.ReplayStep`) whose every draft has probability ``q``; at
    the ``n``-th step (from 1) each row accepted ``accepted(n)`` drafts."""

    def __init__(self, num_rows: int, max_draft: int, q: float, accepted=lambda step: 0):
        self.position = torch.zeros(num_rows, dtype=torch.long)
        self.log_probs = torch.full((num_rows, max_draft), math.log(q))
        self.accepted, self.steps = accepted, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps += 1
        return self.log_probs, torch.full_like(self.position, self.accepted(self.steps))


def probe_steps(cost_profile: CostProfile, q: float, num_rows: int = 4, steps: int = 300,
                model_free: bool = False) -> list[int]:
    """Steps at which ``adaptive`` drafts when every draft has probability ``q`` and is rejected."""
    strategy = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive"), StepCostModel(cost_profile),
                              model_free=model_free)
    phases = ReplayStep(ScriptedRows(num_rows, strategy.max_draft, q))  # every draft rejected
    drafted = []
    for step in range(steps):
        phases.next_step()
        if run_step(strategy, phases, num_rows, strategy.max_draft).num_drafted:
            drafted.append(step)
    return drafted


def test_adaptive_probes_while_a_probe_could_change_the_plan_then_backs_off():
    """Probes take at most 1% of the time while one could change the plan, 0.25% once none could (the cost model's
    price of a probe here: no step times are learnt)."""
    cheap_probe = profile(lambda r, t: 10.0 + 0.5 * r * t, 0.1)  # a probe costs 18% of a plain step at 4 rows
    # q = 0.25: drafting pays above 0.175 acceptance, which the calibrator's upper bound (prior 0.25) allows until
    # four probes have all been rejected: probes first, then after 18 steps (1%), 36, 72; then every 128th
    assert probe_steps(cheap_probe, 0.25) == [0, 18, 54, 126, 254]
    # q = 0.05: one rejected probe puts even the upper bound below break-even: every 128th step only
    assert probe_steps(cheap_probe, 0.05) == [0, 128, 256]
    # a probe costing 50% of a plain step waits 51 steps (probes cost at most 1%), then 102; once none could pay,
    # 201 (at most 0.25%)
    dear_probe = profile(lambda r, t: 10.0 * r * (1 + 0.5 * (t - 1)), 0.1)
    assert probe_steps(dear_probe, 0.85, steps=600) == [0, 51, 153, 354, 555]
    # verifying a second token costs a whole plain step: no acceptance could pay, so probes are 420 steps apart
    assert probe_steps(COSTLY_VERIFY, 0.85, steps=1000) == [0, 420, 840]


def test_a_model_free_drafters_first_probe_waits_until_rows_have_written_a_little():
    """Prompt lookup and suffix drafts copy what was written: at the first steps nothing of the answers has been, so
    their first probe comes after two plain steps (a model's at once); the schedule after it is the same."""
    cheap_probe = profile(lambda r, t: 10.0 + 0.5 * r * t, 0.1)
    with_model, model_free = probe_steps(cheap_probe, 0.25), probe_steps(cheap_probe, 0.25, model_free=True)
    assert with_model[0] == 0 and model_free[0] == AdaptiveBudget.first_probe_after == 2
    assert [step - 2 for step in model_free] == with_model[: len(model_free)]


def test_a_model_free_drafters_every_call_opens_with_plain_steps_so_the_guard_never_judges_fresh_rows():
    """A stream's second call starts from the first call's memory, whose plan drafts. Rows that have just read their
    prompts accept nothing by lookup: drafting at once, the guard saw two steps that lost and stopped drafting for the
    call (code edits ran plain at 147 tok/s where drafting made 181: docs/benchmarks.md). Each call of a model-free
    drafter now opens with plain steps; a drafter with a model drafts at once."""
    cost = StepCostModel(profile(lambda r, t: 10.0 + 0.5 * r * t, 0.1))
    options = TetrisOptions(tetris_strategy="adaptive")

    def call(memory, model_free: bool = True, steps: int = 24) -> tuple[str, AdaptiveBudget]:
        strategy = AdaptiveBudget(options, cost, memory=memory, model_free=model_free)
        # rows as prompt lookup finds them in a call: nothing of the answers written at the first two steps, every
        # draft rejected; after, every draft accepted
        max_draft = strategy.max_draft
        phases = ReplayStep(ScriptedRows(8, max_draft, 0.9, lambda step: 0 if step <= 2 else max_draft))
        drafted = ""
        for _ in range(steps):
            phases.next_step()
            drafted += "d" if run_step(strategy, phases, 8, strategy.max_draft).num_drafted else "."
        return drafted, strategy

    first, strategy = call(None)
    assert first.startswith("..d") and first.endswith("d" * 10) and not strategy.guarded
    memory = strategy.memory  # the pair's memory, as the next call on the pair finds it
    second, strategy = call(memory)
    assert second == ".." + "d" * 22 and not strategy.guarded
    assert call(None, model_free=False)[0][0] == "d"  # a drafter with a model probes at once


def test_the_guards_verdict_holds_down_to_half_the_rows_it_came_at():
    """A verified token costs less in a smaller batch (the weights are read once a step for all rows): the guard that
    stopped drafting at 16 rows keeps 9 rows plain, and at 8 drafting is planned afresh; a verdict of unknown rows
    (a memory saved before they were kept) holds at any rows."""
    def plan_after_guard(guarded_rows: int, num_rows: int) -> DraftPlan:
        strategy = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive"), StepCostModel(FREE_VERIFY))
        strategy.remember(torch.full((32, strategy.max_draft), math.log(0.9)))  # drafts that would pay
        strategy.guarded, strategy.memory.guarded_rows = True, guarded_rows
        return strategy.plan(num_rows)

    assert plan_after_guard(16, 16).num_draft_tokens == 0
    assert plan_after_guard(16, 9).num_draft_tokens == 0
    lifted = plan_after_guard(16, 8)
    assert lifted.num_draft_tokens > 0 and not lifted.probe
    assert plan_after_guard(0, 1).num_draft_tokens == 0


@settings(max_examples=60, deadline=None, derandomize=True)
@given(calls=st.lists(st.lists(st.tuples(st.integers(1, 16), st.sampled_from((0, 0, 1, 6))), min_size=1, max_size=40),
                      min_size=1, max_size=3),
       slope=st.sampled_from((0.1, 1.0, 3.0, 10.0)))
def test_adaptive_across_calls_of_any_batch_sizes_and_acceptance(calls, slope):
    """Calls of a model-free `adaptive` on one memory, each step at any rows accepting none, some or all of its drafts
    (the guard stops drafting in many), verification cheap to dear: every plan is valid, each call's first two steps
    are plain (whatever the memory holds), and no later step runs guarded at half the rows the guard's verdict came at
    or fewer."""
    cost = StepCostModel(profile(lambda r, t: 10.0 + slope * r * t, 0.1))
    memory = None
    for steps in calls:
        strategy = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive"), cost, memory=memory, model_free=True)
        memory = strategy.memory
        for index, (num_rows, accepted) in enumerate(steps):
            guarded_at = memory.guarded_rows if memory.guarded else None
            phases = ReplayStep(ScriptedRows(num_rows, strategy.max_draft, 0.8, lambda step, n=accepted: n))
            phases.next_step()
            step = run_step(strategy, phases, num_rows, strategy.max_draft)
            assert 0 <= step.num_drafted <= strategy.max_draft and step.plan.budget >= 0
            if index < AdaptiveBudget.first_probe_after:
                assert step.num_drafted == 0 and not step.plan.probe
            elif guarded_at is not None and 2 * num_rows <= guarded_at:
                assert not memory.guarded or memory.guarded_rows == num_rows  # lifted (or a fresh verdict here)


def test_a_model_free_drafters_plan_drafts_every_cell_and_its_selection_chooses_how_many():
    """Prompt lookup's cells cost nothing to draft, and a greedy selection re-chooses ``C`` row by row: a plan that
    drafts drafts all ``max_draft`` cells, and the rows that matched surely verify all of them where a plan fitted to
    the pool's mean row (K = 1 here; on code edits at 16 rows, where matched rows accepted 12 of 13 cells) would have
    verified one; rows that matched nothing verify nothing. A drafter with a model, or a sampled call (whose ``C`` is
    fixed before drafting), keeps the plan's ``K``."""
    def first_plan_and_selection(model_free: bool, sampling: bool = False):
        strategy = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive"),
                                  StepCostModel(profile(lambda r, t: 10.0 + r * t, 1e-3), packed=True),
                                  model_free=model_free, sampling=sampling)
        strategy.calibrator.update_cells(torch.full((400,), 0.97), torch.arange(400) < 388)
        strategy.calibrator.update_cells(torch.full((400,), 0.5), torch.arange(400) < 200)
        strategy.remember(torch.full((64, strategy.max_draft), 0.5).log())  # the pool: rows half sure a cell
        strategy._steps_planned = strategy.first_probe_after  # (past a model-free call's opening plain steps)
        plan = strategy.plan(8)
        log_probs = torch.full((8, plan.num_draft_tokens), 0.97).log()
        log_probs[1::2] = float("-inf")  # every other row matched nothing
        return plan, strategy.select(log_probs, torch.full((8,), plan.num_draft_tokens), plan).tolist()

    max_draft = TetrisOptions().num_assistant_tokens + TetrisOptions().tetris_extra_tokens
    plan, lengths = first_plan_and_selection(model_free=True)
    assert (plan.num_draft_tokens, plan.budget) == (max_draft, 8 * max_draft)
    assert lengths == [max_draft, 0] * 4
    plan, lengths = first_plan_and_selection(model_free=False)
    assert plan.num_draft_tokens == 1 and lengths == [1, 0] * 4
    assert first_plan_and_selection(model_free=True, sampling=True)[0].num_draft_tokens == 1


def test_a_plan_is_judged_against_plain_decoding_as_priced_when_it_was_made():
    """The cost model learns from every step, so plain decoding's price moves under a standing plan. A plan stands
    while its predicted speed-up, times what plans realized against theirs, beats 1; its rate as priced then against a
    plain step priced by the scales learnt since stopped plans gaining 6-10% at 16 rows (on code edits) a few steps
    after they began. A plan that stops paying is still stopped by the guard or by what it realized (tests below)."""
    strategy = sure_strategy(learn_costs=False)
    assert strategy.plan(4).num_draft_tokens == 4
    speedup = strategy._planned[-1]
    strategy.cost.target_scale = 0.25  # prices learnt since: a plain step now 4x cheaper than when the plan was made
    assert strategy._open_step(4).step_seconds(4, 0, 0, 0) * strategy._planned[1].rate < 4 < speedup * 4
    assert strategy.plan(4).num_draft_tokens == 4 and not strategy.guarded


def test_adaptive_selects_top_cells_by_calibrated_survival_not_raw_draft_probability():
    options = TetrisOptions(tetris_strategy="adaptive", num_assistant_tokens=2, tetris_extra_tokens=1, tetris_budget=2)
    strategy = AdaptiveBudget(options, StepCostModel(profile(lambda r, t: 10.0 + 0.01 * t, 0.1)))
    # an over-confident draft: its surest cells (q > 0.9) are almost always rejected, its unsure ones accepted
    strategy.calibrator.update_cells(torch.full((400,), 0.97), torch.rand(400) < 0.05)
    strategy.calibrator.update_cells(torch.full((400,), 0.03), torch.rand(400) < 0.95)
    strategy.plan(3)
    log_probs = torch.tensor([[0.99, 0.99, 0.99], [0.9, 0.05, 0.9], [0.02, 0.9, 0.9]]).log()
    lengths = strategy.select(log_probs, torch.full((3,), 3), DraftPlan(3, 2))
    assert lengths.tolist() == [0, 1, 1]  # the cap allows 2 cells; raw q would have chosen row 0's


def test_make_strategy_needs_a_profile_or_the_models(tmp_path):
    with pytest.raises(ValueError, match="tetris_cost_profile"):
        make_strategy(TetrisOptions(tetris_strategy="adaptive"))
    path = FREE_VERIFY.save(tmp_path / "p.json")
    assert isinstance(make_strategy(TetrisOptions(tetris_strategy="dsd", tetris_cost_profile=str(path))), DynamicWindow)
    with pytest.raises(ValueError, match="does not exist"):
        TetrisOptions(tetris_strategy="adaptive", tetris_cost_profile=str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="tetris_cost_profile"):
        TetrisOptions(tetris_strategy="adaptive", tetris_cost_profile=3)


CASES = [(64, 6, 0, "noisy"), (100, 1, 1, "same"), (100, 4, 3, "same"), (257, 5, 2, "independent")]


@pytest.mark.parametrize("vocab,batch,seed,draft_kind", CASES)
def test_greedy_rows_equal_target_alone(vocab, batch, seed, draft_kind, tmp_path, monkeypatch):
    monkeypatch.setenv("TETRIS_HF_CACHE", str(tmp_path))
    target, draft = target_and_draft(vocab, seed, draft_kind, noise=0.3)
    prompts = random_prompts(batch, vocab, seed)
    eos = pick_eos(target, prompts)
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    runs = {}
    for strategy, (cost, source) in itertools.product(
        ("adaptive", "dsd"), [("measured", None), ("free", FREE_VERIFY.to_dict()), ("costly", COSTLY_VERIFY)]
    ):
        runs[strategy, cost] = dict(tetris_strategy=strategy, tetris_cost_profile=source)
    runs["adaptive", "capped"] = dict(tetris_strategy="adaptive", tetris_cost_profile=FREE_VERIFY, tetris_budget=2,
                                      num_assistant_tokens=2, tetris_extra_tokens=3)
    verified = {}
    for name, options in runs.items():
        stats = generate_checked(target, draft, input_ids, mask, references, eos, **options)
        if options.get("tetris_budget") is not None:
            assert max(map(sum, ([max(v, 0) for v in step] for step in stats.verified_per_step))) <= 2
        verified[name] = stats
    if draft_kind == "same":  # every draft is right: with free verification both strategies draft long windows
        for name in ("adaptive", "dsd"):
            stats = verified[name, "free"]
            assert max(stats.num_drafted_per_step) == 6 and stats.accepted_tokens >= 0.9 * stats.verified_tokens > 0
    for name in ("adaptive", "dsd"):  # expensive verification: only probes draft
        stats = verified[name, "costly"]
        assert sum(1 for k in stats.num_drafted_per_step if k) <= 3
    cost_model.clear_memory_cache()


def test_adaptive_sampling_runs_and_keeps_lengths():
    target = tiny_llama(50, seed=4)
    prompts = random_prompts(4, 50, seed=4)
    input_ids, mask = left_pad(prompts)
    torch.manual_seed(0)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=noisy_copy(target, 0.2),
                          custom_generate="tetris", do_sample=True, max_new_tokens=10, pad_token_id=PAD,
                          tetris_strategy="adaptive", tetris_cost_profile=FREE_VERIFY, return_dict_in_generate=True)
    assert out.sequences.shape == (4, input_ids.shape[1] + 10)
    assert out.tetris_stats.verified_tokens > 0


def test_what_adaptive_and_dsd_learn_carries_over_to_the_next_call_on_the_same_pair():
    target = tiny_llama(64, seed=12)
    draft = noisy_copy(target, 0.3, 12)
    input_ids, mask = left_pad(random_prompts(3, 64, seed=12))
    for strategy in ("adaptive", "dsd"):
        first_steps, records = [], []
        for _ in range(2):
            out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                                  do_sample=False, max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True,
                                  tetris_strategy=strategy, tetris_cost_profile=COSTLY_VERIFY,
                                  tetris_step_callback=lambda record, loop: records.append(record))
            first_steps.append(out.tetris_stats.num_drafted_per_step[1])  # step 0 reads the prompt
        assert first_steps == [1, 0]  # a cold start probes; the second call already knows the draft does not pay
        # each step's record says whether it was a probe: here the one step that drafted, and none of the plain ones
        assert [record.probe for record in records] == [record.num_drafted > 0 for record in records]
        assert sum(record.probe for record in records) == 1
    fresh = tiny_llama(64, seed=12)  # another target object: nothing learnt yet
    out = fresh.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                         do_sample=False, max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True,
                         tetris_strategy="adaptive", tetris_cost_profile=COSTLY_VERIFY)
    assert out.tetris_stats.num_drafted_per_step[1] == 1
    # sampling accepts drafts by another rule: what greedy calls learnt does not carry over to it
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          do_sample=True, max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True,
                          tetris_strategy="adaptive", tetris_cost_profile=COSTLY_VERIFY)
    assert out.tetris_stats.num_drafted_per_step[1] == 1


def trim_one_cell_at_a_time(lengths: torch.Tensor, budget: int) -> torch.Tensor:
    """The reference: take a cell from the longest row (the first of equals) until the budget holds."""
    lengths = lengths.clone()
    while int(lengths.sum()) > budget:
        lengths[int(lengths.argmax())] -= 1
    return lengths


@pytest.mark.parametrize("seed", range(30))
def test_budget_trimming_equals_trimming_one_cell_at_a_time(seed):
    generator = torch.Generator().manual_seed(seed)
    longest = 1 + seed % 6
    lengths = torch.randint(0, longest + 1, (1 + seed % 9,), generator=generator)
    for budget in range(0, int(lengths.sum()) + 2):
        assert select_fixed_budget(lengths, budget, longest).tolist() == \
            trim_one_cell_at_a_time(lengths, budget).tolist(), (lengths.tolist(), budget)


def test_adaptive_select_changes_nothing_it_has_learnt():
    """``select`` reads the step's confidences (with what earlier steps did) and predicts as if it had learnt them,
    but the calibrator and pool change only in ``observe``."""
    options = TetrisOptions(tetris_strategy="adaptive", num_assistant_tokens=2, tetris_extra_tokens=0)
    strategy = AdaptiveBudget(options, StepCostModel(FREE_VERIFY))
    log_probs = torch.log(torch.tensor([[0.9, 0.8], [0.3, 0.2]]))
    plan = strategy.plan(2)
    strategy.observe(log_probs, torch.full((2,), 2), torch.tensor([2, 0]))  # a probe's outcome, not read yet
    plan = DraftPlan(2, 4)
    before = (strategy.calibrator.accepted.clone(), strategy.calibrator.rejected.clone(), strategy.pool.clone())
    first = strategy.select(log_probs, torch.full((2,), 2), plan)
    assert torch.equal(strategy.calibrator.accepted, before[0]) and torch.equal(strategy.calibrator.rejected, before[1])
    assert torch.equal(strategy.pool, before[2])
    strategy.observe(log_probs, first, torch.tensor([2, 0]))  # learns the earlier step now
    assert strategy.calibrator.accepted.sum() + strategy.calibrator.rejected.sum() > 0


def drive(strategy: AdaptiveBudget, steps: int, accepted, seconds: StepSeconds | None = None,
          num_rows: int = 4) -> list[int]:
    """Run ``steps`` greedy steps by hand (plan, select, observe), every draft with probability 0.9 and each row
    accepting ``accepted(K)`` of what it verified; returns ``K`` of each step."""
    drafted = []
    for _ in range(steps):
        plan = strategy.plan(num_rows)
        drafted.append(plan.num_draft_tokens)
        log_probs = torch.full((num_rows, plan.num_draft_tokens), 0.9).log()
        lengths = strategy.select(log_probs, torch.full((num_rows,), plan.num_draft_tokens), plan) \
            if plan.num_draft_tokens else torch.zeros(num_rows, dtype=torch.long)
        strategy.observe(log_probs, lengths, torch.minimum(lengths, torch.tensor(accepted(plan.num_draft_tokens))),
                         seconds)
    return drafted


def sure_strategy(learn_costs: bool) -> AdaptiveBudget:
    """``adaptive`` whose model says drafting pays: cheap verification, and a draft whose 0.9-sure cells were right
    nine times in ten."""
    strategy = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive", num_assistant_tokens=4, tetris_extra_tokens=0),
                              StepCostModel(profile(lambda r, t: 10.0 + 0.2 * r * t, 0.5)), learn_costs=learn_costs)
    strategy.calibrator.update_cells(torch.full((400,), 0.9), torch.arange(400) % 10 != 0)
    strategy.remember(torch.full((64, 4), 0.9).log())
    return strategy


def test_the_guard_stops_drafting_once_its_read_steps_emitted_less_than_plain_steps_would_have():
    # every draft rejected, though the model predicted nine in ten accepted: priced steps (no time learnt)
    strategy = sure_strategy(learn_costs=False)
    drafted = drive(strategy, 4, accepted=lambda k: 0)
    assert drafted == [4, 4, 4, 0] and strategy.guarded  # (steps are read a step late: the fourth plan judges)
    # plain, however sure the calibrated model still is of the drafts, until a probe; a probe that drafted lifts the
    # guard and the model plans again, its predictions now weighed by what drafting realized against them: plain
    # again, or drafting for at most two steps (fewer than the guard's three), as that evidence fades probe by
    # probe; the probes back off
    drafted = drive(strategy, 300, accepted=lambda k: 0)
    probes = [step for step, k in enumerate(drafted) if k == 1]
    assert len(probes) >= 2 and all(k == 0 for k in drafted[:probes[0]])
    for probe, after in zip(probes, probes[1:] + [len(drafted)]):
        lost = drafted[probe + 1: after]
        drafting = next((i for i, k in enumerate(lost) if k != 4), len(lost))
        assert drafting <= 2 and all(k == 0 for k in lost[drafting:])
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # wrong again and again: fewer and fewer steps lost
    assert sum(k > 1 for k in drafted) < 2 * len(probes)


def test_the_guard_reads_measured_time_where_the_model_is_wrong_about_cost():
    # every draft accepted, as predicted, but each step took a second where a plain step takes 11 ms: the first step
    # read (at the third plan) realized a small part of its predicted speed-up: the plan is no longer believed (the
    # guard's tally would have needed a second step)
    strategy = sure_strategy(learn_costs=True)
    drafted = drive(strategy, 8, accepted=lambda k: k, seconds=StepSeconds(draft=0.5, verify=0.5, other=0.0))
    assert drafted[:2] == [4, 4] and drafted[2:] == [0] * 6 and strategy.guarded


def test_the_guard_does_not_stop_a_plan_that_pays_for_two_unlucky_steps():
    """Accepted drafts come in bursts (a copied span, then nothing): one row's first two steps of a plan emitting 1
    and 2 tokens where plain steps would have emitted 1.86 each is within a row's spread, not proof that drafting
    loses; the steps after them accept everything, and the plan stands. A plan that loses every step is still
    stopped after ``guard_steps`` (the tests above)."""
    strategy = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive", num_assistant_tokens=4, tetris_extra_tokens=0),
                              StepCostModel(profile(lambda r, t: 10.0 + 0.2 * r * t, 2.0)))
    strategy.calibrator.update_cells(torch.full((400,), 0.9), torch.arange(400) % 10 != 0)
    strategy.remember(torch.full((64, 4), 0.9).log())
    strategy._open_step(1)
    ratio = strategy.cost.step_seconds(1, 4, 4, 4) / strategy.cost.step_seconds(1, 0, 0, 0)
    assert 1 + 2 < 2 * ratio < 2 + 2  # the two steps' 3 tokens: below plain's, by less than a token a step
    accepted = iter([0, 1] + [4] * 40)
    assert drive(strategy, 24, accepted=lambda k: next(accepted), num_rows=1) == [4] * 24 and not strategy.guarded


def test_the_guard_judges_drafting_across_a_batch_that_changes_size_every_step():
    """In a request stream rows join and leave every few steps, and each change of size makes a new plan: drafting
    that loses every step must still be stopped, so the tally carries over plans that go on drafting."""
    strategy = sure_strategy(learn_costs=False)
    drafted = []
    for step in range(12):
        num_rows = 4 - step % 2  # 4, 3, 4, 3, ...: a new plan every step
        plan = strategy.plan(num_rows)
        drafted.append(plan.num_draft_tokens)
        log_probs = torch.full((num_rows, plan.num_draft_tokens), 0.9).log()
        lengths = strategy.select(log_probs, torch.full((num_rows,), plan.num_draft_tokens), plan) \
            if plan.num_draft_tokens else torch.zeros(num_rows, dtype=torch.long)
        strategy.observe(log_probs, lengths, torch.zeros_like(lengths))  # every draft rejected
    assert drafted[:3] == [4, 4, 4] and strategy.guarded and drafted[-1] == 0


def test_the_guard_leaves_a_plan_that_pays_alone():
    strategy = sure_strategy(learn_costs=False)
    assert drive(strategy, 40, accepted=lambda k: k) == [4] * 40 and not strategy.guarded


def test_the_guards_verdict_carries_to_the_next_call_on_the_pair():
    """A call whose guard stopped drafting leaves the pair guarded: the next call (a new strategy on the same memory)
    decodes plainly until a probe drafts, instead of drafting again on the plan the guard just dropped."""
    first = sure_strategy(learn_costs=False)
    assert drive(first, 4, accepted=lambda k: 0) == [4, 4, 4, 0] and first.guarded
    following = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive", num_assistant_tokens=4, tetris_extra_tokens=0),
                               first.cost, memory=first.memory)
    drafted = drive(following, 40, accepted=lambda k: 0)
    probe = drafted.index(1)
    assert probe > 0 and all(k == 0 for k in drafted[:probe])  # plain until the probe, which lifts the guard
    fresh = sure_strategy(learn_costs=False)  # (a pair with no verdict drafts at once)
    assert drive(fresh, 1, accepted=lambda k: 0) == [4]


def test_two_lucky_steps_of_a_losing_plan_do_not_restart_the_probe_schedule():
    """The probe interval starts again only once drafting paid beyond a standard error, as sure as the guard must be
    that it lost: two steps that happen to emit plain's tokens are not proof."""
    strategy = sure_strategy(learn_costs=False)
    strategy.memory.probe_interval = 64
    ratio = strategy._open_step(4).step_seconds(4, 4, 4, 16) / strategy.cost.step_seconds(4, 0, 0, 0)
    assert 4 * 1 < 4 * ratio < 4 * 2  # plain steps would emit between 1 and 2 tokens a row in a drafting step's time
    accepted = iter([1, 0])  # a step above plain's tokens, one below: together just above, within their spread
    drive(strategy, 3, accepted=lambda k: next(accepted, 0))
    assert strategy.memory.probe_interval == 64
    winning = sure_strategy(learn_costs=False)
    winning.memory.probe_interval = 64
    drive(winning, 12, accepted=lambda k: k)  # every draft accepted: it pays, step after step
    assert winning.memory.probe_interval == winning.probe_interval_start


def test_the_guard_prices_plain_steps_as_measured_where_it_learns_from_time():
    """A cost model whose plain step is 3x too dear (its scale fitted on drafting steps) would call a losing plan a
    win; where the strategy learns from step times, the guard prices a plain step as the plain steps it read took."""
    strategy = sure_strategy(learn_costs=True)
    strategy._open_step(4)
    strategy.guarded = True  # plain steps first, measured at 10 ms
    plain = StepSeconds(draft=0.0, verify=0.010, other=0.0)
    drive(strategy, 3, accepted=lambda k: 0, seconds=plain)
    strategy._flush()  # (steps are read lazily, with the next read the loop makes)
    assert strategy.memory.plain_seconds[4] == pytest.approx(0.010)
    strategy.guarded = False
    strategy._planned = None
    strategy.cost.target_scale = 3.0  # the model now prices a plain step at about 3x what it took
    drafted = drive(strategy, 12, accepted=lambda k: 1, seconds=StepSeconds(draft=0.004, verify=0.026, other=0.0))
    assert strategy.guarded and drafted[-1] == 0  # 2 tokens a row in 30 ms against 1 in 10 ms: drafting lost


def test_plans_that_keep_promising_more_than_drafting_realizes_stop_being_believed():
    """Drafting that loses 3% a step where the plan predicted far more: by less than a step's spread, so the guard
    (which stops plans that clearly lose) never fires, and a model still sure enough of its drafts would go on drafting
    at a loss. What plans realized against what they predicted is kept with the pair: a later plan decodes plainly,
    and so does the next call on the pair (probes aside)."""
    strategy = sure_strategy(learn_costs=False)
    ratio = strategy._open_step(4).step_seconds(4, 4, 4, 16) / strategy.cost.step_seconds(4, 0, 0, 0)
    assert 5.9 < 4 * ratio < 6.0  # plain steps emit 5.9-6 tokens in a drafting step's time; the rows below 5.75
    pattern = itertools.cycle([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    drafted = drive(strategy, 64, accepted=lambda k: next(pattern))
    assert drafted[:strategy.replan_every] == [4] * strategy.replan_every and not strategy.guarded
    stopped = drafted.index(0)
    assert stopped <= 2 * strategy.replan_every + 1 and max(drafted[stopped:]) <= 1  # (1: a probe)
    assert strategy.memory.realized[False].factor(strategy.realized_prior) < 0.5
    following = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive", num_assistant_tokens=4, tetris_extra_tokens=0),
                               strategy.cost, memory=strategy.memory)
    assert max(drive(following, 16, accepted=lambda k: next(pattern))) <= 1
    # a pair whose plans realize what they predict keeps drafting (test_the_guard_leaves_a_plan_that_pays_alone), and
    # its memory says so
    paying = sure_strategy(learn_costs=False)
    assert drive(paying, 40, accepted=lambda k: [k, k, k, k]) == [4] * 40
    assert paying.memory.realized[False].factor(paying.realized_prior) > 1.0


def test_probes_are_spaced_by_what_they_cost_as_measured_the_drafts_catch_up_included():
    """Where the strategy learns from step times, a probe is priced as probes took, the draft's catch-up on what
    plain steps skipped included (which no cost model prices): here 3 plain steps' time."""
    cost = StepCostModel(profile(lambda r, t: 10.0 + 0.5 * r * t, 0.1))  # priced, a probe costs 1.18 plain steps
    strategy = AdaptiveBudget(TetrisOptions(tetris_strategy="adaptive"), cost, learn_costs=True)
    plain_step = StepSeconds(draft=0.0, verify=0.010, other=0.0)
    probe_step = StepSeconds(draft=0.001, verify=0.011, other=0.0, catch_up=0.018)
    assert sum(probe_step) == pytest.approx(3 * sum(plain_step))
    drafted = []
    for step in range(1100):
        plan = strategy.plan(4)
        if plan.num_draft_tokens:
            drafted.append(step)
        log_probs = torch.full((4, plan.num_draft_tokens), 0.25).log()
        lengths = strategy.select(log_probs, torch.full((4,), plan.num_draft_tokens), plan) \
            if plan.num_draft_tokens else torch.zeros(4, dtype=torch.long)
        strategy.observe(log_probs, lengths, torch.zeros_like(lengths), probe_step if plan.probe else plain_step)
    assert strategy.memory.probe_cost == pytest.approx(3.0)
    # the first probe at once (no plain step measured before it to price it against), the second after the model's
    # price (18 plain steps), the third after the measured one (200 plain steps: 1%); three rejected probes put even
    # an optimistic plan below plain decoding, so the fourth waits 800 (0.25%)
    assert drafted == [0, 19, 220, 1020]
