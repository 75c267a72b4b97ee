"""How many tokens to draft and which of them to verify, each step: the four step strategies
(:class:`~tetris_hf.step_strategy.StepStrategy`), built by :func:`make_strategy`.

``fixed`` (every row verifies its first ``k``), ``tetris`` (the batch's top ``C = k x B`` cells), ``adaptive`` (``K``
and ``C`` maximising expected tokens per second, then TETRIS) and ``dsd`` (one ``k`` for the batch, the TETRIS paper's
dynamic baseline). Design: docs/design.md, sections "Selection" and "`adaptive`: the guard and the probes".
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .cost_model import AcceptanceCalibrator, StepCostModel, cost_model_for, load_profile
from .goodput import GoodputPlan, best_budget, best_tree_budget, dsd_window, plan_step
from .options import TetrisOptions
from .pair_memory import PairMemory, pair_memory
from .selection import cumulative_log_probs, select_fixed, select_fixed_budget, select_tetris
from .step_strategy import DraftPlan, StepSeconds
from .trees import DraftTree, conditional_log_probs, path_products, select_tree_fixed, select_tree_nodes

# which source drafted a pooled row (hybrid drafting): the model, prompt lookup, or neither (lookup alone drafted and
# the row had no match)
MODEL_ROW, LOOKUP_ROW, UNDRAFTED_ROW = 0, 1, 2
_NOTHING = torch.zeros(0)


class FixedWindow:
    """Standard batched speculative decoding: every active row drafts and verifies ``k`` tokens."""

    def __init__(self, options: TetrisOptions):
        self.k = options.num_assistant_tokens

    def plan(self, num_rows: int) -> DraftPlan:
        # every drafted cell is verified, whatever the draft thought of it: no confidences
        return DraftPlan(self.k, self.k * num_rows, needs_confidences=False)

    def select(self, token_log_probs: torch.Tensor | None, max_lengths: torch.Tensor, plan: DraftPlan) -> torch.Tensor:
        return max_lengths  # every cell a row may verify: it drafted at most k (select_fixed's cap holds already)

    def select_tree(self, tree: DraftTree, plan: DraftPlan) -> torch.Tensor:
        """Draft trees: ``(B, N)`` bool, the nodes each row verifies (a subtree); ``tree.valid`` marks the candidates.
        Fixed: each row's ``k`` best nodes."""
        return select_tree_fixed(tree.log_scores, tree.valid, tree.parents, self.k)

    def observe(self, token_log_probs: torch.Tensor | None, verify_lengths: torch.Tensor, num_accepted: torch.Tensor,
                seconds: StepSeconds | None = None, num_drafted: int | None = None,
                lookup_rows: torch.Tensor | None = None):
        pass


class TetrisSelection(FixedWindow):
    """TETRIS: every row drafts ``k + e``; the ``C`` cells with the highest cumulative draft probability are verified
    (one row, or a budget covering every cell, needs no ranking: such steps skip the draft's confidences)."""

    def __init__(self, options: TetrisOptions):
        super().__init__(options)
        self.extra = options.tetris_extra_tokens
        self.fixed_budget = options.tetris_budget

    def plan(self, num_rows: int) -> DraftPlan:
        num_drafts = self.k + self.extra
        budget = self.k * num_rows if self.fixed_budget is None else self.fixed_budget
        return DraftPlan(num_drafts, budget, needs_confidences=num_rows > 1 and budget < num_rows * num_drafts)

    def select(self, token_log_probs: torch.Tensor | None, max_lengths: torch.Tensor, plan: DraftPlan) -> torch.Tensor:
        if not plan.needs_confidences:  # one row, or every cell: each row's first min(C, K) cells it may verify
            return select_fixed(max_lengths, min(plan.budget, plan.num_draft_tokens))
        return select_tetris(cumulative_log_probs(token_log_probs), max_lengths, plan.budget)

    def select_tree(self, tree: DraftTree, plan: DraftPlan) -> torch.Tensor:
        """TETRIS over trees: the batch's ``C`` best nodes by path score."""
        return select_tree_nodes(tree.log_scores, tree.valid, tree.parents, plan.budget)


class _CostAware:
    """Shared by ``adaptive`` and ``dsd``: the cost model (resolved at the first step, when the batch size is known),
    its online corrections from the loop's measured :class:`StepSeconds` (``learn_costs``), lazy learning, the
    realized-rate guard and the probe schedule (docs/design.md, "`adaptive`: the guard and the probes")."""

    probe_interval_start = 8
    max_probe_interval = 128
    probe_overhead = 0.01  # the share of the time probes may take while one could change the plan
    idle_probe_overhead = 0.0025  # ... and while none could (they only notice requests that became easier)
    smoothing = 0.3
    guard_steps = 2
    guard_confidence = 1.0  # standard errors by which a plan's mean gain a step must fall below 0 for the guard
    guard_row_spread = 0.5  # the least spread of a row's tokens a step, as the guard assumes it (steps agree by chance)
    guard_decay = 0.95  # the weight of a drafting step in the guard's tally falls by this much a newer one (~20 steps)
    realized_decay = 0.98  # the same in what plans realized against their predictions (~50 steps, kept across calls)
    realized_prior = 4.0  # tokens on each side of that ratio before any step (it starts at 1: plans are believed)
    realized_probe_fade = 0.7  # that evidence's weight after each probe

    def __init__(self, options: TetrisOptions, cost: StepCostModel | Callable[[int, int], StepCostModel],
                 learn_costs: bool = False, memory: PairMemory | None = None):
        self.max_draft = options.num_assistant_tokens + options.tetris_extra_tokens
        self._cost_source = cost
        self.cost: StepCostModel | None = cost if isinstance(cost, StepCostModel) else None
        self.learn_costs = learn_costs
        self.memory = memory if memory is not None else PairMemory(probe_interval=self.probe_interval_start)
        self._pending: list[_ObservedStep] = []  # observed steps not read yet (their counts still on the device)
        self._read_steps: list[_ObservedStep] = []  # observed steps read (host counts), not learnt from yet
        self._plan_id = 0  # what drafting steps are tallied under (a new one each time drafting restarts)
        self._running = _RunningStep()  # what the step being run is, until observe keeps it with its counts
        self._tally = _GuardTally()

    @property
    def guarded(self) -> bool:
        """The guard stopped drafting: plain steps until a probe has drafted (kept in the pair's memory)."""
        return self.memory.guarded

    @guarded.setter
    def guarded(self, value: bool) -> None:
        self.memory.guarded = value

    def observe(self, token_log_probs: torch.Tensor | None, verify_lengths: torch.Tensor, num_accepted: torch.Tensor,
                seconds: StepSeconds | None = None, num_drafted: int | None = None,
                lookup_rows: torch.Tensor | None = None):
        """Learn from the steps read since the last observation; keep this one until it is read (lazy learning)."""
        self._learn_read()
        if num_drafted is None:
            num_drafted = token_log_probs.shape[1] if token_log_probs is not None else 0
        self._pending.append(_ObservedStep(token_log_probs, verify_lengths, num_accepted, seconds, num_drafted,
                                           lookup_rows, self._running))

    def _read(self, *wanted: torch.Tensor) -> list[torch.Tensor]:
        """Read the pending steps' counts and ``wanted`` from the device in one transfer; returns ``wanted`` on the
        host. The steps read wait in ``_read_steps`` until :meth:`_learn_read`: reading changes nothing learnt."""
        pending, self._pending = self._pending, []
        tensors = [t for step in pending for t in (step.verify_lengths, step.num_accepted, step.lookup_rows
                                                   if step.lookup_rows is not None else _NOTHING)] + list(wanted)
        host = _to_host(tensors)
        self._read_steps += [
            step._replace(verify_lengths=lengths.long(), num_accepted=accepted.long(),
                          lookup_rows=None if step.lookup_rows is None else lookup_rows.bool())
            for step, lengths, accepted, lookup_rows in zip(pending, host[0::3], host[1::3], host[2::3])]
        return host[3 * len(pending):]

    def _learn_read(self) -> None:
        """Learn from the steps :meth:`_read` brought to the host."""
        steps, self._read_steps = self._read_steps, []
        for step in steps:
            # (a step that drafted by lookup alone ran no draft forward: nothing to correct the draft's cost by)
            self._correct_costs(step.verify_lengths.numel(), 0 if step.running.lookup_only else step.num_drafted,
                                _longest(step.verify_lengths), int(step.verify_lengths.sum()), step.seconds)
            self._time_plain_step(step)
            self._time_probe(step)
            self._count_for_guard(step)
            self._learn(step.token_log_probs, step.verify_lengths, step.num_accepted, step.sources())

    def _new_plan(self) -> None:
        """Drafting (re)starts, after plain steps, a probe or the guard: the steps it runs are tallied afresh (a new
        plan that goes on drafting keeps the tally)."""
        self._plan_id += 1
        self._tally = _GuardTally()

    def _time_plain_step(self, step: _ObservedStep) -> None:
        """Smooth a read plain step's measured seconds into the guard's price of a plain step at its rows (a sample
        taken at most 1.5 times the price so far)."""
        rows = step.verify_lengths.numel()
        if not self.learn_costs or step.seconds is None or step.num_drafted or rows == 0:
            return
        prices = self.memory.plain_seconds  # (kept with the pair: the next call's guard starts from them)
        seconds, old = sum(step.seconds), prices.get(rows)
        if seconds > 0:
            prices[rows] = seconds if old is None else self._smooth(old, min(seconds, 1.5 * old))

    def _time_probe(self, step: _ObservedStep) -> None:
        """Smooth a read probe's measured seconds (the draft's catch-up on what plain steps skipped included) over a
        plain step's at its rows into the pair's ``probe_cost``, what the probe schedule budgets by."""
        plain = self.memory.plain_seconds.get(step.verify_lengths.numel())
        if not self.learn_costs or not step.running.probe or step.seconds is None or not plain:
            return
        cost, old = sum(step.seconds) / plain, self.memory.probe_cost
        self.memory.probe_cost = cost if old is None else self._smooth(old, cost)

    def _count_for_guard(self, step: _ObservedStep) -> None:
        """Add one read step of the current drafting plan to the guard's tally: its tokens, and the tokens plain steps
        would have emitted in its time (one a row per plain step)."""
        rows = step.verify_lengths.numel()
        running = step.running
        if running.plan_id != self._plan_id or step.num_drafted == 0 or rows == 0 or self.cost is None:
            return
        cost, total_verified = self.cost, int(step.verify_lengths.sum())
        seconds = sum(step.seconds) if self.learn_costs and step.seconds is not None else 0.0
        if seconds <= 0:  # (not learning from time, or not measured yet: the model's price of the step as it ran)
            seconds = cost.step_seconds(rows, 0 if running.lookup_only else step.num_drafted,
                                        _longest(step.verify_lengths), total_verified)
        # a plain step's price: as measured at these rows where the strategy learns from step times, else the model's
        plain = self.memory.plain_seconds.get(rows) if self.learn_costs else None
        plain = plain if plain is not None else cost.step_seconds(rows, 0, 0, 0)
        tokens, plain_tokens = float(step.num_accepted.sum()) + rows, rows * seconds / plain if plain > 0 else 0.0
        tally = self._tally = self._tally.add(tokens, plain_tokens, rows, self.guard_decay)
        if running.predicted_speedup > 0:  # what the plan predicted of this step, against what it emitted
            realized = self.memory.realized
            realized[running.lookup_only] = realized[running.lookup_only].add(
                tokens, plain_tokens * running.predicted_speedup, self.realized_decay)
        if tally.won(self.guard_steps, self.guard_confidence, self.guard_row_spread):
            self.memory.probe_interval = self.probe_interval_start  # drafting paid: probe soon when it stops paying

    def _drafting_lost(self) -> bool:
        """The guard's verdict on drafting since it restarted (:meth:`_GuardTally.lost`)."""
        return self._tally.lost(self.guard_steps, self.guard_confidence, self.guard_row_spread)

    def _flush(self) -> None:
        """Read and learn from every pending step."""
        self._read()
        self._learn_read()

    def _learn(self, token_log_probs: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor,
               sources: torch.Tensor | None = None) -> None:
        """Learn acceptance from one observed step (host tensors but ``token_log_probs``; ``sources``: ``(B,)`` which
        source drafted each row, :data:`MODEL_ROW`, :data:`LOOKUP_ROW` or :data:`UNDRAFTED_ROW`, hybrid drafting)."""

    def _open_step(self, num_rows: int) -> StepCostModel:
        if self.cost is None:
            self.cost = self._cost_source(num_rows, self.max_draft + 1)
        return self.cost

    def _correct_costs(self, num_rows: int, num_drafted: int, max_verified: int, total_verified: int,
                       seconds: StepSeconds | None) -> None:
        """Move the cost model towards one measured step (``max_verified``: the longest row's verified drafts;
        ``total_verified``: all rows')."""
        if not self.learn_costs or seconds is None or self.cost is None or num_rows == 0:
            return
        cost = self.cost
        if num_drafted > 0:
            predicted = num_drafted * cost.draft_seconds(num_rows) / cost.draft_scale
            cost.draft_scale = self._smooth(cost.draft_scale, _ratio(seconds.draft, predicted))
        predicted = cost.verify_step_seconds(num_rows, max_verified, total_verified) / cost.target_scale
        cost.target_scale = self._smooth(cost.target_scale, _ratio(seconds.verify, predicted))
        cost.step_overhead = self._smooth(cost.step_overhead, max(seconds.other, 0.0))

    def _smooth(self, old: float, sample: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * sample

    def _after_plan(self, drafts: bool, can_learn: bool, num_rows: int, could_pay: bool = True) -> bool:
        """Update the probe schedule; returns whether this step is a probe."""
        schedule = self.memory
        if not can_learn:  # nothing drafted yet: the first probe (a model-free drafter's after the opening steps)
            schedule.plain_streak = 0
            return True
        if drafts:  # (the probe interval starts again once the guard has seen drafting pay, see _count_for_guard)
            schedule.plain_streak = 0
            return False
        schedule.plain_streak += 1
        interval = max(schedule.probe_interval, self._probe_gap(num_rows, could_pay))
        if not could_pay:
            interval = max(interval, self.max_probe_interval)
        if schedule.plain_streak < interval:
            return False
        schedule.plain_streak = 0
        if could_pay:
            schedule.probe_interval = min(2 * interval, max(self.max_probe_interval, interval))
        return True

    def _probe_gap(self, num_rows: int, could_pay: bool = True) -> int:
        """Plain steps between probes for probes to cost at most ``probe_overhead`` of the time
        (``idle_probe_overhead`` where no probe ``could_pay``): a probe's extra seconds over a plain step's as measured
        (``PairMemory.probe_cost``, the draft's catch-up included), else as the cost model prices its forwards."""
        share = self.probe_overhead if could_pay else self.idle_probe_overhead
        if self.learn_costs and self.memory.probe_cost is not None:
            return math.ceil(max(self.memory.probe_cost - 1, 0.0) / share)
        cost = self.cost
        plain = cost.verify_seconds(num_rows, 1) + cost.step_overhead
        extra = cost.draft_seconds(num_rows) + cost.verify_seconds(num_rows, 2) - cost.verify_seconds(num_rows, 1)
        return math.ceil(extra / plain / share) if plain > 0 else 1


class _RunningStep(NamedTuple):
    """What the step being run is, as the strategy's plan set it (kept with its counts in :class:`_ObservedStep`)."""

    lookup_only: bool = False  # its plan drafts by prompt lookup alone (hybrid)
    plan_id: int = -1  # the drafting plan it belongs to (-1: a probe or a plain step)
    predicted_speedup: float = 0.0  # that plan's predicted speed-up over plain decoding (0: none to learn from)
    probe: bool = False  # a probe


class _ObservedStep(NamedTuple):
    """One step as :meth:`_CostAware.observe` kept it (the ``(B,)`` tensors on the device until read)."""

    token_log_probs: torch.Tensor | None  # (B, K) confidences (None: not computed)
    verify_lengths: torch.Tensor  # (B,)
    num_accepted: torch.Tensor  # (B,)
    seconds: StepSeconds | None
    num_drafted: int  # K
    lookup_rows: torch.Tensor | None = None  # (B,) bool, the rows lookup drafted (hybrid drafting, else None)
    running: _RunningStep = _RunningStep()  # what the plan made of it: lookup alone, its plan, a probe

    def sources(self) -> torch.Tensor | None:
        """``(B,)`` (host) which source drafted each row, or ``None`` (no hybrid drafting)."""
        if self.lookup_rows is None:
            return None
        others = UNDRAFTED_ROW if self.running.lookup_only else MODEL_ROW
        return torch.where(self.lookup_rows, LOOKUP_ROW, others).to(torch.int8)


class _GuardTally(NamedTuple):
    """The guard's count of the drafting steps read since drafting last (re)started: how many, and, each step weighted
    by ``decay`` per newer step, their weight, tokens, plain steps' tokens in their time, squared gains and rows."""

    steps: int = 0
    weight: float = 0.0
    tokens: float = 0.0
    plain_tokens: float = 0.0
    square_gain: float = 0.0
    rows: float = 0.0

    def add(self, tokens: float, plain_tokens: float, rows: int, decay: float) -> "_GuardTally":
        """The tally with one more step: ``tokens`` emitted where plain steps would have emitted ``plain_tokens``."""
        gain = tokens - plain_tokens
        return _GuardTally(self.steps + 1, decay * self.weight + 1, decay * self.tokens + tokens,
                           decay * self.plain_tokens + plain_tokens, decay * self.square_gain + gain * gain,
                           decay * self.rows + rows)

    def lost(self, min_steps: int, confidence: float, row_spread: float) -> bool:
        """Whether drafting lost: after ``min_steps`` steps, the (weighted) mean gain a step is below 0 by more than
        ``confidence`` standard errors, a step's variance at least ``row_spread ** 2`` a row."""
        bounds = self._gain_bounds(min_steps, confidence, row_spread)
        return bounds is not None and bounds[1] < 0

    def won(self, min_steps: int, confidence: float, row_spread: float) -> bool:
        """Whether drafting paid: the mean gain a step above 0 by more than ``confidence`` standard errors."""
        bounds = self._gain_bounds(min_steps, confidence, row_spread)
        return bounds is not None and bounds[0] > 0

    def _gain_bounds(self, min_steps: int, confidence: float, row_spread: float) -> tuple[float, float] | None:
        """``(mean - confidence x standard error, mean + confidence x standard error)`` of the gain a step, or
        ``None`` before ``min_steps`` steps."""
        n = self.weight
        if self.steps < min_steps or n <= 0:
            return None
        mean = (self.tokens - self.plain_tokens) / n
        spread = (self.square_gain / n - mean * mean) * n / max(n - 1, 1e-9) if n > 1 else 0.0
        error = confidence * math.sqrt(max(spread, row_spread ** 2 * self.rows / n) / n)
        return mean - error, mean + error


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the CPU, read from their device in one transfer (float64, shapes kept)."""
    if not tensors:
        return []
    flat = torch.cat([tensor.detach().double().flatten().to(tensors[0].device) for tensor in tensors]).cpu()
    return [part.view(tensor.shape) for part, tensor in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _longest(verify_lengths: torch.Tensor) -> int:
    return int(verify_lengths.max()) if verify_lengths.numel() else 0


def _ratio(measured: float, predicted: float) -> float:
    return min(max(measured / predicted, 0.25), 4.0) if predicted > 0 else 1.0


class AdaptiveBudget(_CostAware):
    """``adaptive``: each step, ``K`` and ``C`` that maximise expected emitted tokens per second, then TETRIS.

    A cell's acceptance is its draft probability through an online :class:`AcceptanceCalibrator`, a row's survival the
    running product along it. :func:`~tetris_hf.goodput.plan_step` picks ``K`` (0: plain decoding) before drafting from
    the pool of recent rows; greedy, :func:`~tetris_hf.goodput.best_budget` re-chooses ``C`` from the drafted cells
    (sampling: the plan's ``C``, fixed before drafting, which keeps the output unbiased). A model-free drafter's cells
    cost nothing: greedy, a plan that drafts drafts all ``max_draft`` of them and the selection chooses. Hybrid
    drafting prices each source and may draft by lookup alone (:attr:`~tetris_hf.step_strategy.DraftPlan.lookup_only`).
    Design: docs/design.md, "Selection", "Hybrid drafting" and "`adaptive`: the guard and the probes".

    Args:
        options: ``K <= num_assistant_tokens + tetris_extra_tokens``; ``tetris_budget`` caps ``C``.
        cost: a :class:`StepCostModel`, or ``(num_rows, max_tokens) -> StepCostModel`` called at the first step.
        learn_costs: correct the cost model from the loop's measured steps (see :class:`_CostAware`).
        memory: a :class:`~tetris_hf.pair_memory.PairMemory` to start from and learn into (default: a fresh one).
        pool_rows: recently drafted rows kept to plan with.
        sampling: the loop samples (``C`` is then fixed before drafting).
        hybrid: the drafter is hybrid (model and lookup): plans may draft by lookup alone.
        model_free: the drafter runs no model (prompt lookup or suffix drafts alone): every call opens with
            :attr:`first_probe_after` plain steps.
    """

    def __init__(self, options: TetrisOptions, cost, learn_costs: bool = False, memory: PairMemory | None = None,
                 pool_rows: int = 256, sampling: bool = False, hybrid: bool = False, model_free: bool = False):
        super().__init__(options, cost, learn_costs, memory)
        self.sampling, self.hybrid = sampling, hybrid
        self.model_free = model_free  # the drafter runs no model (prompt lookup or suffix drafts alone)
        self._steps_planned = 0  # steps this call has planned
        self.max_budget = options.tetris_budget
        self.calibrator = self.memory.calibrator
        self.pool_rows = pool_rows
        # log q of recently drafted rows, newest first, (P, max_draft); NaN past what a row drafted
        self.pool = torch.zeros(0, self.max_draft, dtype=torch.float64)
        self.pool_sources = torch.zeros(0, dtype=torch.int8)  # (P,) which source drafted each pooled row (hybrid)
        if self.memory.pool is not None:
            self._add_rows(self.memory.pool, self.memory.pool_sources)
        # (rows, plan, could_pay, lookup_only, the plan's predicted speed-up over plain decoding: 0 for none to learn)
        self._planned: tuple[int, GoodputPlan, bool, bool, float] | None = None
        self._plan_age = 0
        # (device tensor, its host copy) of the confidences a selection read, kept until the step is learnt
        self._host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _learn(self, token_log_probs: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor,
               sources: torch.Tensor | None = None) -> None:
        """Calibrate on the step's verified cells and add its drafted rows to the planning pool."""
        host_log_probs = self._host_copy(token_log_probs)
        self.calibrator.update(host_log_probs, verify_lengths, num_accepted)
        self.remember(host_log_probs, sources)

    def _host_copy(self, token_log_probs: torch.Tensor) -> torch.Tensor:
        """``token_log_probs`` on the host: the copy :meth:`select` read, else (a probe, which selects without
        reading) read now, in the read that learning makes anyway."""
        for device_copy, host_copy in self._host_copies:
            if device_copy is token_log_probs:
                return host_copy
        return token_log_probs.detach().double().cpu()

    def _keep_host_copies(self, *read: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep the host copies the steps read but not yet learnt need (:meth:`_read` just moved them to
        ``_read_steps``; their confidences were read by an earlier selection), and the ``read`` ones."""
        needed = [step.token_log_probs for step in self._read_steps]
        self._host_copies = [pair for pair in self._host_copies if any(pair[0] is t for t in needed)] + list(read)

    def _calibrator_after_read_steps(self) -> AcceptanceCalibrator:
        """The calibrator as if the steps just read had been learnt: what a selection predicts with."""
        if not self._read_steps:
            return self.calibrator
        calibrator = copy.deepcopy(self.calibrator)
        for step in self._read_steps:
            calibrator.update(self._host_copy(step.token_log_probs), step.verify_lengths, step.num_accepted)
        return calibrator

    def remember(self, token_log_probs: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """Add drafted rows ``(B, K)`` (on the host) to the planning pool; ``sources`` ``(B,)``: which source drafted
        each (hybrid drafting; default the model)."""
        self._add_rows(token_log_probs.double().flip(0), None if sources is None else sources.flip(0))
        self.memory.pool, self.memory.pool_sources = self.pool, self.pool_sources

    def observe(self, token_log_probs: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor,
                seconds: StepSeconds | None = None, num_drafted: int | None = None,
                lookup_rows: torch.Tensor | None = None):
        super().observe(token_log_probs, verify_lengths, num_accepted, seconds, num_drafted, lookup_rows)
        if self._planned is not None and (self._planned[1].num_draft_tokens == 0 or self._planned[3]) \
                and token_log_probs.shape[1] > 0 and not self._running.lookup_only:
            self._planned, self.guarded = None, False  # a probe drafted (the model did): plan again on what it showed

    def _add_rows(self, rows: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """Put ``rows`` ``(n, K)`` (newest first) in front of the pool, cut or NaN-padded to ``max_draft`` cells;
        ``sources`` ``(n,)`` which source drafted each (default the model)."""
        if rows.shape[1] == 0:
            return
        rows = rows[:, : self.max_draft]
        pad = self.max_draft - rows.shape[1]
        if pad > 0:
            rows = torch.cat([rows, rows.new_full((rows.shape[0], pad), float("nan"))], dim=1)
        if sources is None:
            sources = torch.full((rows.shape[0],), MODEL_ROW, dtype=torch.int8)
        self.pool = torch.cat([rows, self.pool])[: self.pool_rows]
        self.pool_sources = torch.cat([sources.to(torch.int8), self.pool_sources])[: self.pool_rows]

    def pool_acceptance(self, num_rows: int | None = None, optimism: float = 0.0) -> torch.Tensor:
        """``(P, max_draft)`` calibrated conditional acceptance of the pooled rows, newest first (the newest
        ``max(32, 4 x num_rows)`` when ``num_rows`` is given); a cell a row did not draft gets the mean of the rows that
        drafted that position (else of every pooled cell). ``optimism``: see :meth:`AcceptanceCalibrator.predict`."""
        pool = self.pool if num_rows is None else self.pool[: max(32, 4 * num_rows)]
        drafted = ~torch.isnan(pool)
        acceptance = torch.zeros_like(pool)
        acceptance[drafted] = self.calibrator.predict(pool[drafted].exp(), optimism)
        if bool(drafted.all()) or pool.shape[0] == 0:
            return acceptance
        counts = drafted.sum(dim=0)
        overall = acceptance[drafted].mean()
        column_mean = torch.where(counts > 0, acceptance.sum(dim=0) / counts.clamp(min=1), overall)
        return torch.where(drafted, acceptance, column_mean[None, :])

    replan_every = 16
    optimism = 2.0
    # a model-free drafter's first steps of each call are plain: rows that have just read their prompts have written
    # nothing of their answers to copy; a probe there learns nothing is accepted and puts the next one far off, and a
    # plan carried from the last call, drafting there, loses those steps and the guard stops drafting for the call
    first_probe_after = 2

    def _opening_step(self) -> bool:
        """Count a planned step; whether it is one of the call's first :attr:`first_probe_after`, which a model-free
        drafter takes plainly whatever the pair's memory would plan (the guard then judges drafting on rows that had
        something to copy)."""
        self._steps_planned += 1
        return self.model_free and self._steps_planned <= self.first_probe_after

    def plan(self, num_rows: int) -> DraftPlan:
        cost = self._open_step(num_rows)
        if self._opening_step():
            self._running = _RunningStep()
            return DraftPlan(0, 0)
        if self.guarded and 2 * num_rows <= self.memory.guarded_rows:
            # the guard's verdict came at twice these rows or more; a verified token costs less in a smaller batch
            # (the weights are read once a step for every row), so drafting is judged afresh: a stream's tail, its
            # rows leaving, is where drafts pay most (docs/benchmarks.md)
            self.guarded, self._planned = False, None
        # the last plan stands until the batch changes size, a probe has drafted, the guard drops it, it aged, or
        # what drafting realized against its predictions says it no longer pays
        stale = self._planned is None or self._planned[0] != num_rows or self._plan_age >= self.replan_every
        if stale or self._drafting_lost() or not self._still_believed():
            if self._planned is None or self.pool.shape[0] == 0 or self.sampling:
                # after a probe, plan on what it showed; a sampled selection reads nothing, so its steps are read here,
                # once a plan (greedy selections read every drafting step: the last one is learnt at the next read)
                self._flush()
            if self._planned is not None and (self._drafting_lost() or not self._still_believed()):
                # the guard: drafting emitted less than plain steps would have in its time, or less than its plan
                # needed to beat them, once what such plans realized against their predictions is counted
                self.guarded, self.memory.guarded_rows = True, num_rows
                memory = self.memory  # (and probes back off, as after one that did not change the plan)
                memory.plain_streak, memory.probe_interval = 0, min(2 * memory.probe_interval, self.max_probe_interval)
            was_drafting = self._planned is not None and self._planned[1].num_draft_tokens > 0 and not self.guarded
            self._planned = (num_rows, *self._choose(num_rows, cost))
            self._plan_age = 0
            if not (was_drafting and self._planned[1].num_draft_tokens > 0):
                self._new_plan()
        elif self.pool.shape[0] == 0 and self._pending:
            self._flush()  # the first drafted rows: whether a probe can teach anything depends on them
        self._plan_age += 1
        _, plan, could_pay, lookup_only, speedup = self._planned
        # (probes teach what the model's drafts are worth: a plan drafting by lookup alone counts as plain for them)
        probe = self._after_plan(plan.num_draft_tokens > 0 and not lookup_only, can_learn=self.pool.shape[0] > 0,
                                 num_rows=num_rows, could_pay=could_pay)
        if probe and self.max_draft > 0 and self.max_budget != 0:
            # (what drafting realized counts for less at each probe: a pair whose plans were not believed is tried
            # again now and then, as the probes back off)
            self.memory.realized = {key: gain.faded(self.realized_probe_fade)
                                    for key, gain in self.memory.realized.items()}
            self._running = _RunningStep(probe=True)  # (a probe teaches acceptance: the guard does not count it)
            return DraftPlan(1, num_rows, probe=True)
        drafting = plan.num_draft_tokens > 0
        self._running = _RunningStep(lookup_only, self._plan_id if drafting else -1, speedup if drafting else 0.0)
        return DraftPlan(plan.num_draft_tokens, plan.budget, lookup_only=lookup_only)

    def _choose(self, num_rows: int, cost: StepCostModel) -> tuple[GoodputPlan, bool, bool, float]:
        """``(plan, could_pay, lookup_only, speedup)``: the best plan on the pool, whether a plan drafting with the
        model could beat it at an optimistic acceptance (probes are rare otherwise), (hybrid) whether lookup drafts
        alone, and the plan's predicted speed-up over plain decoding (0: nothing to learn from its steps). A drafting
        plan must beat plain decoding by its prediction times what such plans realized against theirs
        (:meth:`_realized_rate`)."""
        plain = cost.step_seconds(num_rows, 0, 0, 0)
        plain_plan = GoodputPlan(0, 0, float(num_rows), plain)

        def best(acceptance: torch.Tensor, lookup_only: bool = False) -> GoodputPlan:
            plan = plan_step(acceptance, num_rows, self.max_draft, cost, self.max_budget, 0.0 if lookup_only else None)
            return plan if self._realized_rate(plan, lookup_only) > plain_plan.rate else plain_plan

        def speedup(plan: GoodputPlan) -> float:
            return plan.rate / plain_plan.rate if plan.num_draft_tokens > 0 else 0.0

        if self.guarded:  # plain steps, probes as scheduled, until a probe has drafted
            return plain_plan, True, False, 0.0

        def every_cell(plan: GoodputPlan) -> GoodputPlan:
            return plan._replace(num_draft_tokens=self.max_draft, budget=num_rows * self.max_draft)

        if not self.hybrid:
            plan = best(self.pool_acceptance(num_rows))
            could_pay = plan.num_draft_tokens > 0 or best(
                self.pool_acceptance(num_rows, self.optimism)).num_draft_tokens > 0
            predicted = speedup(plan)
            if plan.num_draft_tokens > 0 and self.model_free and not self.sampling:
                # a model-free drafter's cells cost nothing to draft, and a greedy selection re-chooses C from them row
                # by row (a row that matched nothing verifies nothing): the plan decides whether to draft, the
                # selection how much (its K, fitted to the pool's mean row, cut rows that matched: docs/design.md)
                plan = every_cell(plan)
            return plan, could_pay, False, predicted
        both, alone = self.hybrid_acceptance(num_rows)
        with_model, lookup_plan = best(both), best(alone, lookup_only=True)
        lookup_only = lookup_plan.num_draft_tokens > 0 and \
            self._realized_rate(lookup_plan, True) > self._realized_rate(with_model, False)
        plan = lookup_plan if lookup_only else with_model
        predicted = speedup(plan)
        if plan.num_draft_tokens == 0 and not self.sampling:
            # Lookup's drafts are free and a greedy selection chooses C from the drafted cells (none where none pays):
            # where nothing matches, a step by lookup alone costs what a plain one does, and it shows where lookup
            # matches, which plain steps never would. (No prediction to learn from: it expects plain's rate.)
            plan, lookup_only = every_cell(plan), True
        optimistic = best(self.hybrid_acceptance(num_rows, self.optimism)[0])
        could_pay = (plan.num_draft_tokens > 0 and not lookup_only) or (
            optimistic.num_draft_tokens > 0 and self._realized_rate(optimistic, False) > plan.rate)
        return plan, could_pay, lookup_only, predicted

    def _still_believed(self) -> bool:
        """Whether the standing plan, if it drafts, still beats plain decoding once its predicted speed-up is corrected
        by what drafting realized so far (:meth:`_realized_factor`; a greedy selection reads every drafting step, so the
        evidence is at most a step old). The speed-up is the plan's rate over plain's, both as the cost model priced
        them when the plan was made: the scales it learns move every step, so a plain step priced now is not the one the
        plan was measured against (docs/design.md)."""
        _, plan, _, lookup_only, speedup = self._planned
        if plan.num_draft_tokens == 0 or speedup == 0:
            return True
        return speedup * self._realized_factor(lookup_only) > 1

    def _realized_rate(self, plan: GoodputPlan, lookup_only: bool) -> float:
        """A plan's predicted rate, for a drafting one times what drafting plans (by the model, or by lookup alone)
        emitted against what they predicted (:class:`~tetris_hf.pair_memory.RealizedGain`, kept with the pair): a
        model that keeps promising more than drafting realizes (a calibration or a price it gets wrong, costs it does
        not see) stops being believed, and one that promised too little is believed more."""
        if plan.num_draft_tokens == 0:
            return plan.rate
        return plan.rate * self._realized_factor(lookup_only)

    def _realized_factor(self, lookup_only: bool) -> float:
        """What drafting plans (by the model, or by lookup alone) emitted against what they predicted, pulled towards 1
        by :attr:`realized_prior` tokens (:meth:`~tetris_hf.pair_memory.RealizedGain.factor`)."""
        return self.memory.realized[lookup_only].factor(self.realized_prior)

    def hybrid_acceptance(self, num_rows: int, optimism: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Hybrid drafting: ``(P, max_draft)`` each pooled row's acceptance in a step where both sources draft (a row
        unmatched in a lookup-alone step takes the model rows' mean), and where lookup drafts alone (model rows: 0)."""
        acceptance = self.pool_acceptance(num_rows, optimism)
        sources = self.pool_sources[: acceptance.shape[0]]
        alone = torch.where((sources == LOOKUP_ROW)[:, None], acceptance, 0.0)
        model_rows = sources == MODEL_ROW
        both = acceptance
        if bool(model_rows.any()):
            both = torch.where((sources == UNDRAFTED_ROW)[:, None], acceptance[model_rows].mean(dim=0), acceptance)
        return both, alone

    def select(self, token_log_probs: torch.Tensor, max_lengths: torch.Tensor, plan: DraftPlan) -> torch.Tensor:
        num_rows, num_drafted = token_log_probs.shape
        if plan.probe:
            lengths = max_lengths.clamp(max=num_drafted)
            return lengths if self.max_budget is None else select_fixed_budget(lengths, self.max_budget, num_drafted)
        host_log_probs, host_max_lengths = self._read(token_log_probs, max_lengths)  # the strategy's one read
        self._keep_host_copies((token_log_probs, host_log_probs))  # (a read: observe learns from it)
        survival = self._calibrator_after_read_steps().predict(host_log_probs.exp()).cumprod(dim=1)
        scores = survival.log().to(token_log_probs.device)
        if self.sampling:
            return select_tetris(scores, max_lengths, plan.budget)
        cost = self.cost
        # drafting is already paid (lookup's alone: nothing)
        fixed_seconds = (0 if plan.lookup_only else num_drafted * cost.draft_seconds(num_rows)) + cost.step_overhead
        choice = best_budget(survival, host_max_lengths.long(), fixed_seconds,
                             cost.verify_prices(num_rows, num_drafted), self.max_budget, cost.packed)
        return select_tetris(scores, max_lengths, int(choice.budget[0]))

    def select_tree(self, tree: DraftTree, plan: DraftPlan) -> torch.Tensor:
        """Draft trees: greedy, ``C`` re-chosen from the drafted nodes (:func:`~tetris_hf.goodput.best_tree_budget`),
        then the ``C`` best by survival; sampling, the plan's ``C`` by path score; a probe, each row's best node."""
        budget = plan.budget if self.max_budget is None else min(plan.budget, self.max_budget)
        if plan.probe or self.sampling:
            return select_tree_nodes(tree.log_scores, tree.valid, tree.parents, budget,
                                     max_per_row=1 if plan.probe else None)
        num_rows, num_nodes = tree.tokens.shape
        conditional = conditional_log_probs(tree)
        pending = [step.token_log_probs for step in self._pending if step.token_log_probs is not None]
        # the strategy's one read; the pending steps' confidences come along, for observe to learn from
        host_conditional, valid, parents, *pending_host = self._read(conditional, tree.valid, tree.parents, *pending)
        self._keep_host_copies(*zip(pending, pending_host))
        survival = path_products(self._calibrator_after_read_steps().predict(host_conditional.exp()), parents.long())
        cost = self.cost
        # (drafting is already paid; the plan's K, which a row near its length limit may have cut short)
        fixed_seconds = plan.num_draft_tokens * cost.draft_seconds(num_rows) + cost.step_overhead
        choice = best_tree_budget(survival, valid.bool(), fixed_seconds, cost.verify_prices(num_rows, num_nodes),
                                  self.max_budget, cost.packed)
        return select_tree_nodes(survival.log().to(tree.log_scores.device), tree.valid, tree.parents, choice)


class DynamicWindow(_CostAware):
    """``dsd``: one ``k`` for every row, the one maximising ``B (1 - a^(k+1)) / (1 - a)`` per predicted second, the
    acceptance rate ``a <- 0.85 a + 0.15 observed`` (the first verified step sets it; docs/design.md, "Selection")."""

    def __init__(self, options: TetrisOptions, cost, learn_costs: bool = False, memory: PairMemory | None = None):
        super().__init__(options, cost, learn_costs, memory)
        self.acceptance: float | None = self.memory.dsd_acceptance

    def plan(self, num_rows: int) -> DraftPlan:
        cost = self._open_step(num_rows)
        if self._pending:
            self._flush()  # the strategy's one read
        window = dsd_window(self.acceptance, num_rows, self.max_draft, cost) if self.acceptance is not None else 0
        probe = self._after_plan(window > 0, self.acceptance is not None, num_rows) and self.max_draft > 0
        self._running = _RunningStep(probe=probe)
        window = 1 if probe else window
        return DraftPlan(window, window * num_rows, probe, needs_confidences=False)  # one k for all: no ranking

    def select(self, token_log_probs: torch.Tensor | None, max_lengths: torch.Tensor, plan: DraftPlan) -> torch.Tensor:
        return select_fixed(max_lengths, plan.num_draft_tokens)

    def select_tree(self, tree: DraftTree, plan: DraftPlan) -> torch.Tensor:
        """Draft trees: each row's ``k`` best nodes, ``k`` the window chosen for the batch."""
        return select_tree_fixed(tree.log_scores, tree.valid, tree.parents, plan.num_draft_tokens)

    def _learn(self, token_log_probs: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor,
               sources: torch.Tensor | None = None) -> None:
        accepted = int(num_accepted.sum())
        rejections = int((num_accepted < verify_lengths).sum())
        if accepted + rejections == 0:
            return
        observed = accepted / (accepted + rejections)
        self.acceptance = observed if self.acceptance is None else 0.85 * self.acceptance + 0.15 * observed
        self.memory.dsd_acceptance = self.acceptance


def make_strategy(options: TetrisOptions, model: torch.nn.Module | None = None,
                  assistant_model: torch.nn.Module | None = None, sampling: bool = False,
                  packed: bool = False) -> FixedWindow | AdaptiveBudget | DynamicWindow:
    """The strategy ``options`` name. ``adaptive`` and ``dsd`` need ``options.tetris_cost_profile`` (used as given) or
    the two models (profiled at the first step, :func:`~tetris_hf.cost_model.cost_model_for`, then corrected online;
    what they learn carries over to the next call on the pair, :func:`~tetris_hf.pair_memory.pair_memory`).
    ``sampling``: the loop samples (the call then neither learns from step times nor carries what earlier calls
    learnt: the same seed gives the same tokens). ``packed``: the cost model prices verify blocks packed.

    Raises:
        ValueError: ``adaptive`` or ``dsd`` with neither a cost profile nor the models to profile.
    """
    if options.tetris_strategy == "tetris":
        return TetrisSelection(options)
    if options.tetris_strategy == "fixed":
        return FixedWindow(options)
    source, learn_costs = options.tetris_cost_profile, True
    if source is not None:
        cost, learn_costs = StepCostModel(load_profile(source), packed=packed), False  # taken as it is
    elif model is None or (assistant_model is None and options.model_free_tokens is None):
        raise ValueError(f"tetris_strategy={options.tetris_strategy!r} needs `tetris_cost_profile=` or the target and "
                         "draft models to profile")
    else:
        def cost(num_rows: int, max_tokens: int) -> StepCostModel:
            return cost_model_for(model, assistant_model, num_rows=num_rows, max_tokens=max_tokens, packed=packed)
    hybrid = assistant_model is not None and options.model_free_tokens is not None
    # (a sampled call's plans decide which random numbers are drawn: it plans on nothing the clock or earlier calls set)
    learn_costs = learn_costs and not sampling
    memory = (pair_memory(model, assistant_model, hybrid, compiled=bool(options.tetris_compile))
              if model is not None and not sampling else None)
    if options.tetris_strategy == "adaptive":
        return AdaptiveBudget(options, cost, learn_costs=learn_costs, memory=memory, sampling=sampling, hybrid=hybrid,
                              model_free=assistant_model is None)
    return DynamicWindow(options, cost, learn_costs=learn_costs, memory=memory)
