"""``tetris-hf simulate``: record per-step acceptance traces from real runs, replay them under a cost curve.

``tetris-hf simulate record`` runs the batched loop on real prompts with every drafted cell verified (``K`` drafts per
row, budget ``K x B``) and writes one JSONL line per step and active row: the draft log-probability of each cell and
how many cells the target accepted before the first rejection (greedy: draft token == target argmax given the drafted
prefix; with sampling, one draw of the rejection sampler).

``tetris-hf simulate replay`` projects the throughput of no speculation, fixed-``k``, DSD, TETRIS and ``adaptive`` for
batch sizes 1-256 under a forward-time curve (a measured :class:`~tetris_hf.cost_model.CostProfile`, or a curve file
such as ``shared/data/h200_curve_8b.json``), driving the real strategy objects of :mod:`tetris_hf.strategies` through
the loop's own step (:func:`~tetris_hf.step.run_step`: plan, select, observe) on rows resampled from the traces.

Assumptions of the replay (what the projection is, and is not):

- **Acceptance transfers.** The traces come from the pair that recorded them; projecting them onto a curve of another
  target (an 8B model) assumes that pair's draft would be as confident and as right as the recorded one.
- **Prefix semantics.** A row that verifies ``l`` cells of a recorded step accepts ``min(l, n)`` of them (``n``: the
  recorded accepted prefix when all ``K`` cells were verified) and emits that plus one target token. This holds
  exactly for greedy decoding; for sampling it is one draw.
- **Rows are recorded requests.** Each simulated row replays one recorded request's steps in order, one recorded
  step per simulated step whatever the row emitted, and when the request runs out a new random request takes the
  row (continuous batching: the batch stays full). A recorded step's acceptance does not depend on what the strategy
  did before it. All strategies see the same rows (same seed).
- **Step time is the curve.** A step costs ``K`` draft forwards over ``B`` rows plus one target forward over
  ``B x (1 + longest verified)`` (every row's block is padded to the longest), interpolated piecewise-linearly in
  ``B`` and tokens from the curve (made monotone), extrapolated linearly beyond its largest ``B`` (CPU curve: 16 rows,
  8B H200 curve: 128 rows). Prefill, sampling, scheduling, the growth of the KV cache and any fixed per-step
  overhead are left out.
- **Strategies.** fixed-``k`` and TETRIS (``C = k x B``, ``K = k + e``) are shown at their best ``k`` per batch size
  (chosen in hindsight); DSD and ``adaptive`` choose ``K <= K_recorded`` online, starting cold (``adaptive`` learns
  its acceptance calibration during the replay) and use the curve as their cost model.

``tetris-hf simulate replay-steps`` replays what real runs did instead, chains and draft trees alike: the step traces
``tetris-hf bench`` writes (``step-traces.jsonl``: per step, per row, the draft tokens or tree nodes the target verified
and how many it accepted, under the run's own strategy and budget). No strategy is re-run; a recorded row-step is
replayed as it happened. Its assumptions (see :func:`step_seconds` and :func:`replay_steps`):

- **Row-steps are independent draws.** A simulated step of ``B`` rows takes ``B`` row-steps drawn uniformly with
  replacement from the run's recorded ones (the call's first step, the prompt's forward, left out), each with its
  nodes verified ``n`` and drafts accepted ``a``; the step emits ``sum (a + 1)`` tokens. Which nodes a row verified
  was decided at the recorded batch size (TETRIS shares ``C = k x B`` across the recorded rows), so the projection is
  the recorded run's at the recorded ``B``; at larger ``B`` it assumes the per-row distribution stays the same.
- **The target verifies a block.** A step verifying ``n_1 .. n_B`` nodes costs one target forward over
  ``B x (1 + max n)`` tokens (every row's block padded to the widest; a tree's nodes cost what a chain's tokens cost).
- **The draft grows a tree of ``K`` levels in ``K`` forwards:** the first over ``B`` rows x 1 token (the root), each
  of the other ``K - 1`` over the ``w`` frontier nodes of every row, timed as the curve's draft forward over ``B x w``
  rows x 1 token (``w = 1``: ``K`` forwards over ``B`` rows, as for a chain). ``K`` is the step's most levels among
  its rows. A plain step (``K = 0``) costs one target forward over ``B x 1``.
- **Plain decoding** emits ``B`` tokens per target forward over ``B x 1``; the ratio is tokens per second against it
  at the same ``B``. Prefill, sampling, scheduling, KV growth and per-step overhead are left out, as above.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .bench import STEP_TRACE_FORMAT, STEP_TRACE_VERSION
from .cli import UsageError, load_pair, load_prompt_set, number_list, prompt_texts, resolve_device
from ..cost_model import CostProfile, StepCostModel, load_profile
from ..step import Emission, Observation, Proposal, StepPhases, Verdict, run_step
from ..options import TetrisOptions
from ..strategies import AdaptiveBudget, DynamicWindow, FixedWindow, TetrisSelection

TRACE_FORMAT = "tetris-hf-trace"
TRACE_VERSION = 1
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SHARED_CURVES = ("h200_curve_8b.json", "h200_curve_smol.json", "cpu_curve_smol.json")


# ---------------------------------------------------------------------------------------------------------------
# Recording


def record_traces(model: torch.nn.Module, assistant_model: torch.nn.Module, input_ids: torch.LongTensor,
                  attention_mask: torch.Tensor | None = None, *, num_draft_tokens: int = 8, first_request: int = 0,
                  draft_vocab: int | torch.Tensor | None = None, **generate_kwargs) -> list[dict]:
    """Run the batched loop with every cell verified and return one trace row per step and active row.

    Args:
        model, assistant_model: the target and the draft.
        input_ids, attention_mask: ``(B, T)`` left-padded prompts.
        num_draft_tokens: ``K``, cells drafted (and all verified) per row and step.
        first_request: request number of row 0 (to number rows across batches).
        draft_vocab: ``tetris_draft_vocab`` (the draft's head restricted to a token subset), ``None`` for full.
        generate_kwargs: for ``generate()`` (``max_new_tokens``, ``do_sample``, ``eos_token_id``, ...).

    Returns:
        Dicts ``{"request", "step", "log_probs" (K floats), "accept" (1 accepted, 0 the first rejection, None never
        reached), "accepted", "verified", "emitted"}``.
    """
    from ..generation import generate

    records = []
    with torch.no_grad():
        generate(model, input_ids, attention_mask=attention_mask, assistant_model=assistant_model,
                 num_assistant_tokens=num_draft_tokens, tetris_extra_tokens=0, tetris_strategy="fixed",
                 tetris_draft_vocab=draft_vocab, tetris_step_callback=lambda record, loop: records.append(record),
                 **generate_kwargs)
    rows = []
    for step, record in enumerate(records):
        log_probs = record.token_log_probs.float().cpu().tolist()
        for index, row in enumerate(record.rows.tolist()):
            accepted, verified = int(record.num_accepted[index]), int(record.verify_lengths[index])
            flags = [1 if j < accepted else 0 if j == accepted < verified else None for j in range(record.num_drafted)]
            rows.append({
                "request": first_request + row, "step": step, "log_probs": [round(v, 5) for v in log_probs[index]],
                "accept": flags, "accepted": accepted, "verified": verified, "emitted": int(record.emitted[index]),
            })
    return rows


def write_traces(path: str | os.PathLike, rows: list[dict], header: dict) -> Path:
    """JSONL: a header line ``{"format": "tetris-hf-trace", ...}``, then one line per row and step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        out.write(json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION, **header}) + "\n")
        for row in rows:
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
    return path


@dataclass
class TraceSet:
    """Recorded steps grouped by request: ``requests[r] = (log_probs (S_r, K), accepted (S_r,))`` in step order.

    Only steps where the row verified all ``K`` cells are kept (a row near its length limit verifies fewer, and what
    the rest would have done is unknown)."""

    num_draft_tokens: int
    requests: list[tuple[torch.Tensor, torch.Tensor]]
    headers: list[dict] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return sum(len(accepted) for _, accepted in self.requests)

    def acceptance_by_position(self) -> list[float]:
        """``P(cell j accepted | cells before it accepted)`` over all recorded steps, per position."""
        accepted = torch.cat([a for _, a in self.requests])
        rates = []
        for j in range(self.num_draft_tokens):
            reached = (accepted >= j).sum()
            rates.append(float((accepted > j).sum() / reached) if reached else 0.0)
        return rates


def _read_jsonl(path: str | os.PathLike, what: str, kind: str, version: int, hint: str = "") -> tuple[dict, list[str]]:
    """A JSONL file's header (checked to be ``{"format": kind, "version": version, ...}``) and its other lines."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ValueError(f"cannot read {what} file {path}: {error}") from error
    if not lines:
        raise ValueError(f"{what} file {path} is empty")
    header = json.loads(lines[0])
    if not isinstance(header, dict) or header.get("format") != kind or header.get("version") != version:
        raise ValueError(f"{path} is not a {kind} v{version} file{hint}")
    return header, lines[1:]


def read_traces(paths: list[str | os.PathLike]) -> TraceSet:
    """Read one or more trace files (their ``K`` must agree; request numbers are kept apart per file)."""
    by_request: dict[tuple[int, int], list[tuple[int, list[float], int]]] = {}
    num_draft, headers = None, []
    for file_index, path in enumerate(paths):
        header, lines = _read_jsonl(path, "trace", TRACE_FORMAT, TRACE_VERSION)
        if num_draft is not None and header["num_draft_tokens"] != num_draft:
            raise ValueError(f"{path} has K={header['num_draft_tokens']}, earlier files K={num_draft}")
        num_draft = int(header["num_draft_tokens"])
        headers.append(header)
        for line in lines:
            row = json.loads(line)
            if row["verified"] == num_draft and len(row["log_probs"]) == num_draft:
                by_request.setdefault((file_index, row["request"]), []).append(
                    (row["step"], row["log_probs"], row["accepted"]))
    requests = []
    for steps in by_request.values():
        steps.sort()
        requests.append((torch.tensor([s[1] for s in steps], dtype=torch.float64),
                         torch.tensor([s[2] for s in steps], dtype=torch.long)))
    if not requests:
        raise ValueError("the traces hold no step where a row verified all its cells")
    return TraceSet(num_draft, requests, headers)


# ---------------------------------------------------------------------------------------------------------------
# Replay


class RowSampler:
    """Feeds ``batch_size`` simulated rows from recorded requests: each row walks one request's steps in order and
    takes a new random request when it runs out."""

    def __init__(self, traces: TraceSet, batch_size: int, seed: int = 0):
        self.log_probs = torch.cat([lp for lp, _ in traces.requests])
        self.accepted = torch.cat([a for _, a in traces.requests])
        lengths = torch.tensor([len(a) for _, a in traces.requests])
        self.starts = torch.cumsum(lengths, 0) - lengths
        self.ends = self.starts + lengths
        self.generator = torch.Generator().manual_seed(seed)
        chosen = self._draw(batch_size)
        offsets = (torch.rand(batch_size, generator=self.generator) * lengths[chosen]).long()
        self.position, self.end = self.starts[chosen] + offsets, self.ends[chosen]  # start mid-request: steady state

    def _draw(self, count: int) -> torch.Tensor:
        return torch.randint(len(self.starts), (count,), generator=self.generator)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, K)`` draft log-probs and ``(B,)`` accepted prefix lengths of this step's rows."""
        log_probs, accepted = self.log_probs[self.position], self.accepted[self.position]
        self.position = self.position + 1
        done = self.position >= self.end
        if bool(done.any()):
            fresh = self._draw(int(done.sum()))
            self.position[done], self.end[done] = self.starts[fresh], self.ends[fresh]
        return log_probs, accepted


class ReplayStep(StepPhases):
    """A step's phases on recorded rows: the draft is the recorded confidences, the target accepts what it accepted
    when they were recorded (at most what is verified), and nothing runs on a model."""

    def __init__(self, sampler: RowSampler):
        self.sampler = sampler
        self.rows = torch.arange(len(sampler.position))
        self.log_probs: torch.Tensor | None = None  # (B, K) this step's recorded confidences
        self.recorded: torch.Tensor | None = None  # (B,) and accepted prefixes

    def next_step(self) -> None:
        """Move every row on to its next recorded step."""
        self.log_probs, self.recorded = self.sampler.next()

    def draft(self, num_drafted: int, confidences: bool, lookup_only: bool = False) -> Proposal:
        log_probs = self.log_probs[:, :num_drafted]
        return Proposal(torch.zeros(log_probs.shape, dtype=torch.long), log_probs, None)

    def select(self, strategy, proposal: Proposal, plan) -> torch.Tensor:
        num_drafted = proposal.tokens.shape[1]
        if num_drafted == 0:
            return torch.zeros(len(self.rows), dtype=torch.long)
        return strategy.select(proposal.log_probs, torch.full((len(self.rows),), num_drafted), plan)

    def verify(self, proposal: Proposal, verify_lengths: torch.Tensor) -> tuple[Verdict, None]:
        num_accepted = torch.minimum(verify_lengths, self.recorded)
        return Verdict(num_accepted, torch.zeros_like(num_accepted), verify_lengths), None

    def emit(self, verdict: Verdict) -> Emission:
        return Emission(verdict.num_accepted + 1, torch.zeros_like(verdict.num_accepted, dtype=torch.bool))

    def observation(self, proposal: Proposal, selection: torch.Tensor, verdict: Verdict) -> Observation:
        return Observation(proposal.log_probs, selection)


@dataclass
class ReplayResult:
    """Totals of one replay: ``tokens`` emitted (accepted drafts + one target token per row and step)."""

    batch_size: int
    steps: int
    tokens: int
    seconds: float
    drafted: int
    verified: int
    accepted: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {**self.__dict__, "tokens_per_second": self.tokens_per_second,
                "tokens_per_row_step": self.tokens / max(self.steps * self.batch_size, 1)}


def replay(strategy, traces: TraceSet, cost: StepCostModel, batch_size: int, steps: int,
           seed: int = 0) -> ReplayResult:
    """Run ``strategy`` for ``steps`` steps of ``batch_size`` rows drawn from ``traces``, timing each by ``cost``.

    Returns totals; ``tokens`` counts every row's accepted drafts plus its target token, each step.
    """
    phases = ReplayStep(RowSampler(traces, batch_size, seed))
    total = ReplayResult(batch_size, steps, 0, 0.0, 0, 0, 0)
    for _ in range(steps):
        phases.next_step()
        step = run_step(strategy, phases, batch_size, traces.num_draft_tokens)
        verify_lengths = step.verdict.verify_lengths
        accepted = int(step.verdict.num_accepted.sum())
        total.tokens += batch_size + accepted
        total.seconds += cost.step_seconds(batch_size, step.num_drafted, int(verify_lengths.max()),
                                           int(verify_lengths.sum()))
        total.drafted += step.num_drafted * batch_size
        total.verified += int(verify_lengths.sum())
        total.accepted += accepted
    return total


def replay_strategies(fixed_ks: tuple[int, ...], extra: int, max_draft: int, cost: StepCostModel) -> dict:
    """Name -> factory of a fresh strategy object, for every strategy the replay compares."""
    strategies = {"no-SD": lambda: TetrisSelection(TetrisOptions(tetris_budget=0))}
    for k in fixed_ks:
        if k <= max_draft:
            strategies[f"fixed k={k}"] = lambda k=k: FixedWindow(TetrisOptions(num_assistant_tokens=k))
        if k + extra <= max_draft:
            strategies[f"tetris k={k} e={extra}"] = lambda k=k: TetrisSelection(
                TetrisOptions(num_assistant_tokens=k, tetris_extra_tokens=extra))
    wide = TetrisOptions(num_assistant_tokens=max_draft, tetris_extra_tokens=0)
    strategies["dsd"] = lambda: DynamicWindow(wide, cost)
    strategies["adaptive"] = lambda: AdaptiveBudget(wide, cost)
    return strategies


def steps_for(batch_size: int, row_steps: int, min_steps: int) -> int:
    return max(min_steps, math.ceil(row_steps / batch_size))


def simulate_curve(traces: TraceSet, cost: StepCostModel, batch_sizes, fixed_ks, extra: int, row_steps: int = 2048,
                   min_steps: int = 64, seed: int = 0) -> list[dict]:
    """Replay every strategy at every batch size; per batch size a dict with each strategy's totals and the best
    fixed-``k`` and TETRIS runs."""
    results = []
    for batch_size in batch_sizes:
        steps = steps_for(batch_size, row_steps, min_steps)
        runs = {}
        for name, make in replay_strategies(fixed_ks, extra, traces.num_draft_tokens, cost).items():
            # the cost model is shared and never corrected (learn_costs is off), so each strategy sees the same curve
            runs[name] = replay(make(), traces, cost, batch_size, steps, seed).to_dict()
        best = lambda prefix: max((n for n in runs if n.startswith(prefix)),  # noqa: E731
                                  key=lambda n: runs[n]["tokens_per_second"], default=None)
        results.append({"batch_size": batch_size, "steps": steps, "runs": runs,
                        "best_fixed": best("fixed"), "best_tetris": best("tetris")})
    return results


def format_table(results: list[dict]) -> str:
    header = (f"{'B':>4} {'no-SD tok/s':>11} {'best fixed':>17} {'best TETRIS':>21} {'DSD':>6} {'adaptive':>8} "
              f"{'adapt/best':>10}")
    lines = [header, "-" * len(header)]
    for result in results:
        runs = result["runs"]
        plain = runs["no-SD"]["tokens_per_second"]
        ratio = lambda name: runs[name]["tokens_per_second"] / plain if name else float("nan")  # noqa: E731
        others = max(runs[n]["tokens_per_second"] for n in runs if n != "adaptive")
        fixed, tetris = result["best_fixed"], result["best_tetris"]
        lines.append(
            f"{result['batch_size']:>4} {plain:>11.1f} {ratio(fixed):>5.2f}x ({fixed or '-':>9}) "
            f"{ratio(tetris):>5.2f}x ({(tetris or '-').replace('tetris ', ''):>11}) {ratio('dsd'):>5.2f}x "
            f"{ratio('adaptive'):>7.2f}x {runs['adaptive']['tokens_per_second'] / others:>10.2f}"
        )
    return "\n".join(lines)


def plot(curves: list[dict], path: Path) -> bool:
    """Speed-up over no speculation against batch size, one panel per curve; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4.2), squeeze=False)
    for axis, curve in zip(axes[0], curves):
        sizes = [r["batch_size"] for r in curve["results"]]
        series = {"best fixed-k": lambda r: r["best_fixed"], "best TETRIS (C = kB)": lambda r: r["best_tetris"],
                  "DSD": lambda r: "dsd", "adaptive": lambda r: "adaptive"}
        for label, pick in series.items():
            values = [r["runs"][pick(r)]["tokens_per_second"] / r["runs"]["no-SD"]["tokens_per_second"]
                      if pick(r) else float("nan") for r in curve["results"]]
            axis.plot(sizes, values, marker="o", label=label)
        axis.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="no speculation")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch size (rows)")
        axis.set_ylabel("projected tokens/s vs no speculation")
        axis.set_title(curve["name"], fontsize=9)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# ---------------------------------------------------------------------------------------------------------------
# Step traces: what real runs (chains and draft trees) did, replayed on a curve


@dataclass
class StepTrace:
    """One bench run's recorded row-steps (the prompt's forward of every call left out), each ``(S,)`` long:
    ``drafted`` (the step's ``K``: draft levels), ``verified`` (draft tokens or tree nodes the target checked) and
    ``accepted`` (drafts accepted). ``tree_width`` ``w`` (1: chains), ``batch_size`` the recorded ``B``."""

    run: str
    tree_width: int
    batch_size: int
    drafted: torch.Tensor
    verified: torch.Tensor
    accepted: torch.Tensor
    header: dict = field(default_factory=dict)

    @property
    def tokens_per_row_step(self) -> float:
        return float((self.accepted + 1).sum()) / len(self.accepted)

    @property
    def tokens_per_verified_node(self) -> float | None:
        verified = int(self.verified.sum())
        return float((self.accepted + 1).sum()) / verified if verified else None


def step_traces_from_run(run: dict, header: dict | None = None) -> StepTrace:
    """A :class:`StepTrace` from one run line of ``step-traces.jsonl``
    (:func:`tetris_hf.tools.bench.write_step_traces`): every row that had not finished, in every step but each call's
    first."""
    drafted, verified, accepted = [], [], []
    for call in run["calls"]:
        for num_drafted, verified_row, accepted_row in call[1:]:
            for v, a in zip(verified_row, accepted_row):
                if v >= 0:
                    drafted.append(num_drafted)
                    verified.append(v)
                    accepted.append(a)
    if not verified:
        raise ValueError(f"run {run['run']!r} recorded no step after the prompt's")
    long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return StepTrace(run["run"], int(run.get("tree_width", 1)), int(run["batch_size"]), long(drafted),
                     long(verified), long(accepted), dict(header or {}))


def read_step_traces(path: str | os.PathLike) -> list[StepTrace]:
    """Every run of a ``step-traces.jsonl`` file that ``tetris-hf bench`` wrote."""
    header, lines = _read_jsonl(path, "step trace", STEP_TRACE_FORMAT, STEP_TRACE_VERSION,
                                " (tetris-hf bench writes step-traces.jsonl)")
    return [step_traces_from_run(json.loads(line), header) for line in lines if line.strip()]


def step_seconds(cost: StepCostModel, rows: int, num_drafted: int, max_verified: int, tree_width: int = 1,
                 total_verified: int | None = None) -> float:
    """One step of ``rows`` rows on the curve: ``K = num_drafted`` draft forwards (the first over ``rows`` x 1 token,
    the others over ``rows x tree_width`` frontier nodes, timed as that many rows x 1 token) and one target forward
    over ``rows x (1 + max_verified)`` padded, or ``rows + total_verified`` tokens packed (``cost.packed``; every row
    ``max_verified`` when ``total_verified`` is not given). ``K = 0``: a plain step, the target's forward alone.

    E.g. ``rows = 16, K = 6, w = 3, max_verified = 9``: ``draft(16) + 5 draft(48) + target(16, 10)`` padded.
    """
    draft = 0.0
    if num_drafted > 0:
        draft = cost.draft_seconds(rows) + (num_drafted - 1) * cost.draft_seconds(rows * tree_width)
    total = rows * max_verified if total_verified is None else total_verified
    return draft + cost.verify_step_seconds(rows, max_verified, total) + cost.step_overhead


def replay_steps(trace: StepTrace, cost: StepCostModel, batch_size: int, steps: int, seed: int = 0) -> ReplayResult:
    """``steps`` steps of ``batch_size`` row-steps drawn from ``trace`` (uniform, with replacement), each timed by
    :func:`step_seconds` with the step's largest ``K`` and ``verified`` (and, packed, its total); a row emits its accepted drafts plus one
    target token."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(trace.accepted), (steps, batch_size), generator=generator)
    drafted, verified, accepted = trace.drafted[picks], trace.verified[picks], trace.accepted[picks]  # (steps, B)
    step_drafted = drafted.amax(dim=1).tolist()
    step_verified, step_total = verified.amax(dim=1).tolist(), verified.sum(dim=1).tolist()
    seconds = sum(step_seconds(cost, batch_size, k, n, trace.tree_width, total)
                  for k, n, total in zip(step_drafted, step_verified, step_total))
    total_accepted = int(accepted.sum())
    drafted_nodes = sum(k * batch_size * trace.tree_width for k in step_drafted)  # levels x w (upper bound on nodes)
    return ReplayResult(batch_size, steps, steps * batch_size + total_accepted, seconds, drafted_nodes,
                        int(verified.sum()), total_accepted)


def plain_tokens_per_second(cost: StepCostModel, batch_size: int) -> float:
    """Plain decoding on the curve: ``B`` tokens per target forward over ``B x 1``."""
    return batch_size / step_seconds(cost, batch_size, 0, 0)


def simulate_steps(traces: list[StepTrace], cost: StepCostModel, batch_sizes, row_steps: int = 4096,
                   min_steps: int = 64, seed: int = 0) -> list[dict]:
    """Every run at every batch size: ``[{run, tree_width, recorded_batch_size, recorded tokens per row-step and per
    verified node, by_batch: [{batch_size, plain_tokens_per_second, ratio, ...ReplayResult}]}]``."""
    results = []
    for trace in traces:
        by_batch = []
        for batch_size in batch_sizes:
            result = replay_steps(trace, cost, batch_size, steps_for(batch_size, row_steps, min_steps), seed)
            plain = plain_tokens_per_second(cost, batch_size)
            by_batch.append({**result.to_dict(), "plain_tokens_per_second": plain,
                             "ratio": result.tokens_per_second / plain})
        results.append({"run": trace.run, "tree_width": trace.tree_width, "recorded_batch_size": trace.batch_size,
                        "recorded_row_steps": len(trace.accepted),
                        "tokens_per_row_step": trace.tokens_per_row_step,
                        "tokens_per_verified_node": trace.tokens_per_verified_node, "by_batch": by_batch})
    return results


def format_steps_table(results: list[dict]) -> str:
    """One line per run: recorded tokens per row-step and per verified node, then the projected ratio to plain
    decoding at each batch size."""
    sizes = [entry["batch_size"] for entry in results[0]["by_batch"]] if results else []
    width = max([10] + [len(r["run"]) for r in results])
    header = f"{'run':<{width}} {'tok/step':>8} {'tok/node':>8} " + " ".join(f"{f'B={b}':>7}" for b in sizes)
    lines = [header, "-" * len(header)]
    for result in results:
        node = result["tokens_per_verified_node"]
        lines.append(f"{result['run']:<{width}} {result['tokens_per_row_step']:>8.2f} "
                     f"{'-' if node is None else f'{node:.2f}':>8} "
                     + " ".join(f"{entry['ratio']:>6.2f}x" for entry in result["by_batch"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    record = sub.add_parser("record", help="run real prompts with every cell verified and write JSONL traces")
    record.add_argument("--output", default="traces.jsonl", help="trace file to write")
    record.add_argument("--prompts", default="sharegpt", help="sharegpt | mtbench | humaneval | FILE.jsonl")
    record.add_argument("--num-prompts", type=int, default=16)
    record.add_argument("--batch-size", type=int, default=16)
    record.add_argument("--max-new-tokens", type=int, default=64)
    record.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts")
    record.add_argument("--draft-tokens", type=int, default=8, help="K: cells drafted and verified per row and step")
    record.add_argument("--target", default=None, help="Hub id, local directory or .gguf (default: SmolLM2-135M)")
    record.add_argument("--draft", default=None, help="draft directory, early-exit:N, or a model id")
    record.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    record.add_argument("--do-sample", action="store_true", help="record sampling acceptance (one draw per cell)")
    record.add_argument("--draft-vocab", type=int, default=None,
                        help="restrict the draft's head to its N most frequent tokens (tetris_draft_vocab=N)")
    record.add_argument("--seed", type=int, default=0)
    replay_parser = sub.add_parser("replay", help="project throughput from traces under cost curves")
    replay_parser.add_argument("--traces", action="append", required=True, help="trace file (repeatable)")
    replay_parser.add_argument("--curve", action="append", default=None,
                               help="cost curve: a saved profile JSON or a curve file, FILE[:TARGET:DRAFT] to pick "
                                    "its models (repeatable; default: the shared H200 8B, H200 smol and CPU curves)")
    replay_parser.add_argument("--batch-sizes", type=number_list(int, 1), default=DEFAULT_BATCH_SIZES)
    replay_parser.add_argument("--fixed-k", type=number_list(int, 1), default=(1, 2, 3, 4, 6), help="k of fixed and TETRIS runs")
    replay_parser.add_argument("--extra", type=int, default=2, help="TETRIS e")
    replay_parser.add_argument("--row-steps", type=int, default=2048, help="simulated row-steps per batch size")
    replay_parser.add_argument("--min-steps", type=int, default=64, help="at least this many steps per batch size")
    replay_parser.add_argument("--output", default="simulate-out", help="directory for simulate.json and simulate.png")
    replay_parser.add_argument("--seed", type=int, default=0)
    replay_parser.add_argument("--padded", action="store_true",
                               help="price verify forwards as padded rectangles (tetris_pack=False), not by the "
                                    "tokens a packed forward computes")
    replay_parser.add_argument("--draft-cost-ratio", type=float, default=None,
                               help="time a draft forward over B rows as this fraction of the curve's target forward "
                                    "over B x 1 tokens (e.g. the draft's measured CPU ratio) instead of the curve's "
                                    "draft entry")
    steps_parser = sub.add_parser("replay-steps", help="replay the step traces of tetris-hf bench runs (chains and "
                                                       "draft trees) under cost curves")
    steps_parser.add_argument("--traces", action="append", required=True,
                              help="a step-traces.jsonl that tetris-hf bench wrote (repeatable)")
    steps_parser.add_argument("--curve", action="append", default=None,
                              help="as for replay (default: the shared H200 8B, H200 smol and CPU curves)")
    steps_parser.add_argument("--batch-sizes", type=number_list(int, 1), default=None,
                              help="default: the recorded batch size and the larger of 16, 32, ..., 256")
    steps_parser.add_argument("--row-steps", type=int, default=4096, help="simulated row-steps per batch size")
    steps_parser.add_argument("--min-steps", type=int, default=64, help="at least this many steps per batch size")
    steps_parser.add_argument("--draft-cost-ratio", type=float, default=None, help="as for replay")
    steps_parser.add_argument("--output", default="simulate-out", help="directory for simulate-steps.json")
    steps_parser.add_argument("--seed", type=int, default=0)
    steps_parser.add_argument("--padded", action="store_true",
                              help="price verify forwards as padded rectangles (tetris_pack=False), not by the "
                                   "tokens a packed forward computes")


def default_curves() -> list[str]:
    """The shared H200 and CPU curve files, looked for in ``../shared/data`` of the working directory and of this
    checkout."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        folder = root.parent / "shared" / "data"
        found = [str(folder / name) for name in SHARED_CURVES if (folder / name).is_file()]
        if found:
            return found
    return []


def _curve_name(source: str, cost: StepCostModel) -> str:
    meta = cost.profile.meta
    target, draft = meta.get("target", "?"), meta.get("draft", "?")
    return f"{Path(source.split(':')[0]).stem}: {target} / draft {draft}"


def draft_as_ratio(profile: CostProfile, ratio: float) -> CostProfile:
    """``profile`` with its draft forward over ``B`` rows timed as ``ratio`` x its target forward over ``B`` x 1."""
    draft = {rows: ratio * ms for (rows, tokens), ms in profile.target.items() if tokens == 1}
    if not draft:
        raise UsageError("--draft-cost-ratio needs a curve with target forwards of one token per row")
    return CostProfile(dict(profile.target), draft, {**profile.meta, "draft": f"{ratio:g} x target step"})


def run_record(args) -> int:
    if args.draft_tokens < 1 or args.batch_size < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        raise UsageError("--draft-tokens, --batch-size, --num-prompts and --max-new-tokens must be >= 1")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise UsageError(f"--draft-vocab must be a positive number of tokens, got {args.draft_vocab}")
    from .bench import ensure_token_counts

    prompt_set = load_prompt_set(args.prompts)
    device = resolve_device(args.device)
    target, draft, tokenizer, info = load_pair(args.target, args.draft, device)
    vocab_source = ensure_token_counts(draft, tokenizer, [args.draft_vocab])
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts, _ = prompt_texts(prompt_set, args.num_prompts, tokenizer, args.max_prompt_tokens)
    print(info)
    torch.manual_seed(args.seed)
    rows = []
    for start in range(0, len(texts), args.batch_size):
        batch = tokenizer(texts[start : start + args.batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False).to(device)
        rows += record_traces(target, draft, batch["input_ids"], batch["attention_mask"],
                              num_draft_tokens=args.draft_tokens, first_request=start, draft_vocab=args.draft_vocab,
                              max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                              pad_token_id=tokenizer.pad_token_id)
        print(f"recorded prompts {start + 1}-{start + batch['input_ids'].shape[0]} of {len(texts)}", flush=True)
    header = {"num_draft_tokens": args.draft_tokens, "target": info.target, "draft": info.draft,
              "prompts": args.prompts, "num_prompts": len(texts), "batch_size": args.batch_size,
              "max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "device": str(device),
              "draft_vocab": args.draft_vocab, "draft_vocab_source": vocab_source}
    path = write_traces(args.output, rows, header)
    traces = read_traces([path])
    rates = ", ".join(f"{rate:.2f}" for rate in traces.acceptance_by_position())
    print(f"wrote {len(rows)} row-steps to {path}; acceptance by position (given the earlier ones accepted): {rates}")
    return 0


def _load_curves(sources: list[str], draft_cost_ratio: float | None,
                 packed: bool = True) -> list[tuple[str, StepCostModel]]:
    if draft_cost_ratio is not None and not draft_cost_ratio > 0:
        raise UsageError(f"--draft-cost-ratio must be positive, got {draft_cost_ratio}")
    curves = []
    for source in sources:
        try:
            profile = load_profile(source)
        except (ValueError, TypeError, KeyError) as error:
            raise UsageError(f"bad --curve {source}: {error}") from None
        if draft_cost_ratio is not None:
            profile = draft_as_ratio(profile, draft_cost_ratio)
        curves.append((source, StepCostModel(profile, packed=packed)))
    return curves


def run_replay_steps(args) -> int:
    if args.row_steps < 1 or args.min_steps < 1:
        raise UsageError("--row-steps and --min-steps must be >= 1")
    traces = []
    for path in args.traces:
        try:
            runs = read_step_traces(path)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
            raise UsageError(f"bad step traces: {error}") from None
        if len(args.traces) > 1:  # runs of several files (prompt sets) in one table: named by their set
            for trace in runs:
                trace.run = f"{trace.header.get('prompts') or Path(path).parent.name}: {trace.run}"
        traces += runs
    if not traces:
        raise UsageError("the step traces hold no speculative run")
    sources = args.curve or default_curves()
    if not sources:
        raise UsageError("no --curve given and no shared/data curves found beside this checkout")
    curves = _load_curves(sources, args.draft_cost_ratio, packed=not args.padded)
    recorded = max(trace.batch_size for trace in traces)
    batch_sizes = args.batch_sizes or (recorded, *(b for b in DEFAULT_BATCH_SIZES if b > max(recorded, 8)))
    assumptions = __doc__.split(":func:`replay_steps`):")[1].strip()
    report = {"traces": [{"file": path} for path in args.traces], "batch_sizes": list(batch_sizes),
              "assumptions": assumptions, "curves": []}
    for source, cost in curves:
        name = _curve_name(source, cost)
        results = simulate_steps(traces, cost, batch_sizes, args.row_steps, args.min_steps, args.seed)
        print(f"\n{name}  (projected tokens/s against plain decoding at each B; tok/step and tok/node as recorded)")
        print(format_steps_table(results))
        report["curves"].append({"name": name, "source": source, "profile": cost.profile.to_dict(),
                                 "results": results})
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "simulate-steps.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {output / 'simulate-steps.json'}")
    return 0


def run_replay(args) -> int:
    if args.extra < 0 or args.row_steps < 1 or args.min_steps < 1:
        raise UsageError("--extra must be >= 0, --row-steps and --min-steps >= 1")
    try:
        traces = read_traces(args.traces)
    except (ValueError, KeyError, json.JSONDecodeError) as error:
        raise UsageError(f"bad traces: {error}") from None
    sources = args.curve or default_curves()
    if not sources:
        raise UsageError("no --curve given and no shared/data curves found beside this checkout")
    curves = _load_curves(sources, args.draft_cost_ratio, packed=not args.padded)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    rates = traces.acceptance_by_position()
    print(f"traces: {len(traces.requests)} requests, {traces.num_steps} row-steps, K={traces.num_draft_tokens}; "
          f"acceptance by position: {', '.join(f'{r:.2f}' for r in rates)}")
    report = {"traces": {"files": list(args.traces), "headers": traces.headers, "requests": len(traces.requests),
                         "row_steps": traces.num_steps, "acceptance_by_position": rates},
              "assumptions": __doc__.split("(what the projection is, and is not):")[1].split("``tetris-hf simulate "
                                                                                           "replay-steps``")[0].strip(),
              "curves": []}
    for source, cost in curves:
        name = _curve_name(source, cost)
        results = simulate_curve(traces, cost, args.batch_sizes, args.fixed_k, args.extra, args.row_steps,
                                 args.min_steps, args.seed)
        print(f"\n{name}  (tokens/s of no-SD; the rest as speed-up over it)")
        print(format_table(results))
        report["curves"].append({"name": name, "source": source, "profile": cost.profile.to_dict(),
                                 "results": results})
    (output / "simulate.json").write_text(json.dumps(report, indent=1))
    wrote = [str(output / "simulate.json")]
    if plot(report["curves"], output / "simulate.png"):
        wrote.append(str(output / "simulate.png"))
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    print("\nwrote " + ", ".join(wrote))
    return 0


def main(args) -> int:
    actions = {"record": run_record, "replay": run_replay, "replay-steps": run_replay_steps}
    return actions[args.action](args)
