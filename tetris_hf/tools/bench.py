"""``tetris-hf bench``: TETRIS against the baselines users have, side by side in one process, on real prompts.

For one prompt set, batch size and ``max_new_tokens`` it runs, on the same prompts:

- ``generate``: plain batched ``generate()`` (no speculation) — the reference every greedy output must equal;
- ``hf-assisted``: transformers' own assisted generation, one request at a time (its only option), on a subset;
- ``hf-lookup``: transformers' own prompt-lookup decoding (``prompt_lookup_num_tokens=k``, no draft model), one
  request at a time (its only option), on every prompt, once per ``k``;
- ``fixed``: standard batched speculative decoding, every row verifying its first ``k`` drafts, for each ``k``;
- ``tetris``: TETRIS with each ``e`` at the fixed runs' budget ``C = k x B`` (or ``--budget``);
- any other ``tetris_strategy`` name (e.g. ``adaptive``, ``dsd``) once per ``k``.

The speculative runs draft with the draft model, with an EAGLE head (``--draft eagle``: the head shipped for the
default target; ``eagle:PATH_OR_REPO``: a published one), or with ``--draft lookup`` by prompt lookup: each row drafts the
tokens that followed an earlier occurrence of its last n-gram (n <= ``--max-ngram``) in its own prompt and output,
the one with the most to copy, then the longest match with the row's end, then the latest
(``prompt_lookup_num_tokens=k, max_matching_ngram_size=n`` and no ``assistant_model``). Lookup pays on grounded
prompts, whose answers copy the prompt: ``--prompts humaneval-edit`` or ``sharegpt-summarize``.

``--sources model,lookup,hybrid`` (with a draft model or an EAGLE head) runs every speculative run once per draft
source in one process: the model alone (``... model``), prompt lookup alone (``... lookup n=3``: ``assistant_model``
None) and both (``... hybrid n=3``: each row drafts by lookup where it matches, by the model elsewhere, one ranking).
It is the comparison the ``mixed`` prompt set (chat, code edits and summaries interleaved) is made for.

``--tree-width 1,2,3`` repeats every speculative run with draft trees (``tetris_tree_width=w``, named ``... w=W``) at
the same ``k``, ``e`` and budget ``C``: each row drafts ``K = k + e`` levels of ``w`` children of the ``w`` best
nodes (the same ``K`` draft forwards, over ``w`` nodes a row instead of one), and the strategy verifies ``C`` nodes.
The speculative runs' per-step counts (nodes verified and drafts accepted per row) go to ``step-traces.jsonl``, which
``tetris-hf simulate replay-steps`` replays on forward-time curves.

Per run it reports output tokens/s, per-request latency (all requests arrive at time 0 and batches run one after
the other, so a request's latency is when its batch returned), acceptance rate, VSR, target forwards per generated
token, tokens emitted per row-step, tokens per verified node (output tokens / verified draft tokens or nodes), and peak
memory; it prints a table, writes ``results.json``, ``bench.png`` and ``step-traces.jsonl``, and fails (exit 1) when a
greedy speculative output differs from plain ``generate()`` (in bf16/fp16: where the target's choice was clear, not at
a near-tie; see :mod:`tetris_hf.tools.divergence`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from .cli import (UsageError, add_kernel_argument, apply_kernels, load_pair, load_prompt_set, number_list,
                  prompt_texts, resolve_device)
from .divergence import RowDivergence

BASELINES = ("generate", "hf-assisted", "hf-lookup")
SOURCES = ("model", "lookup", "hybrid")  # --sources: the draft model alone, prompt lookup alone, both (hybrid)
ONE_AT_A_TIME = ("hf-assisted", "hf-lookup")
DEFAULT_STRATEGIES = "generate,hf-assisted,fixed,tetris,adaptive"
DEFAULT_STRATEGIES_LOOKUP = "generate,hf-lookup,fixed,tetris,adaptive"  # transformers' assisted generation needs a model
DEFAULT_STRATEGIES_EAGLE = "generate,fixed,tetris,adaptive"  # transformers has no EAGLE  # transformers' speculative decoding serves one request per call


@dataclasses.dataclass
class BenchConfig:
    """What to run. ``strategies`` names runs: ``generate``, ``hf-assisted``, ``hf-lookup``, or a ``tetris_strategy``
    value. ``lookup``: the speculative runs draft by prompt lookup (n-grams of at most ``max_ngram`` tokens) instead of
    with a draft model; ``max_ngram`` also applies to ``hf-lookup``."""

    batch_size: int = 16
    max_new_tokens: int = 64
    strategies: tuple[str, ...] = ("generate", "hf-assisted", "fixed", "tetris", "adaptive")
    num_assistant_tokens: tuple[int, ...] = (4,)
    extra_tokens: tuple[int, ...] = (1, 2, 3)
    budget: int | None = None
    hf_assisted_prompts: int = 4
    do_sample: bool = False
    seed: int = 0
    repeats: int = 1
    draft_vocabs: tuple[int | None, ...] = (None,)  # tetris_draft_vocab of the speculative runs (None: full)
    lookup: bool = False
    max_ngram: int = 3
    tree_widths: tuple[int, ...] = (1,)  # tetris_tree_width of the speculative runs (1: chains)
    padded: bool = False  # also run every speculative run with tetris_pack=False, named "... padded"
    sources: tuple[str, ...] = ("model",)  # with a draft: every speculative run once per draft source (see SOURCES)
    confidence_threshold: float | None = None  # also run every model-drafted run with it, named "... stop<X"


@dataclasses.dataclass
class RunResult:
    """One strategy's measurements. ``outputs[i]`` are request ``i``'s generated tokens (``None``: not run)."""

    name: str
    strategy: str
    options: dict
    requests: int
    tokens: int
    seconds: float
    latencies: list[float]
    target_forwards: int
    row_steps: int
    drafted: int
    verified: int
    accepted: int
    peak_memory_mb: float
    outputs: list
    agreement: dict | None = None  # output_agreement with plain generate() (greedy runs)
    repeat_seconds: list[float] = dataclasses.field(default_factory=list)  # every repeat's time (this is the median)
    position_counts: "PositionCounts | None" = None  # speculative runs: acceptance at each draft position
    steps: list | None = None  # speculative runs: per generate() call, per step [K, verified per row, accepted per row]
    draft_seconds: float = 0.0  # speculative runs: the loop's own draft and verify time (TetrisStats)
    verify_seconds: float = 0.0
    target_tokens: int = 0  # speculative runs: tokens the target's step forwards computed, and those selected
    selected_tokens: int = 0
    lookup_verified: int = 0  # speculative runs: verified cells of rows prompt lookup drafted (all of a lookup run's)

    def summary(self) -> dict:
        latencies = sorted(self.latencies)
        return {
            "name": self.name,
            "strategy": self.strategy,
            "options": self.options,
            "requests": self.requests,
            "output_tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens / self.seconds if self.seconds else 0.0,
            "tokens_per_second_repeats": [self.tokens / seconds for seconds in self.repeat_seconds if seconds],
            "latency_mean_s": statistics.fmean(latencies) if latencies else 0.0,
            "latency_p50_s": _percentile(latencies, 50),
            "latency_p99_s": _percentile(latencies, 99),
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "vsr": self.accepted / self.verified if self.verified else None,
            "drafted_tokens": self.drafted,
            "verified_tokens": self.verified,
            "accepted_tokens": self.accepted,
            "target_forwards_per_token": self.target_forwards / self.tokens if self.tokens else 0.0,
            "tokens_per_row_step": self.tokens / self.row_steps if self.row_steps else 0.0,
            # output tokens (accepted drafts + the target's token of every row-step) per draft token or tree node the
            # target verified: what a verified node buys; None when nothing was verified
            "tokens_per_verified_node": self.tokens / self.verified if self.verified else None,
            "peak_memory_mb": self.peak_memory_mb,
            "agreement_with_generate": self.agreement,
            "acceptance_by_position": self.position_counts.rates() if self.position_counts else None,
            # [accepted, reached] per position, for intervals
            "acceptance_by_position_counts": ([list(pair) for pair in zip(self.position_counts.accepted,
                                                                          self.position_counts.reached)]
                                              if self.position_counts else None),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            # tokens the target computed per token selected (1.0: packed, no padding); None for baselines
            "computed_per_selected": self.target_tokens / self.selected_tokens if self.selected_tokens else None,
            # share of the verified cells that prompt lookup drafted (hybrid runs: the rest the model's)
            "lookup_share_of_verified": self.lookup_verified / self.verified if self.verified else None,
        }


@dataclasses.dataclass
class PositionCounts:
    """Acceptance at each draft position: ``reached[i]`` row-steps whose draft position ``i + 1`` was verified with
    every earlier position accepted, ``accepted[i]`` those that accepted it too. ``rates()[i]`` is the acceptance of
    position ``i + 1`` given the ones before it were accepted (EAGLE's ``n-alpha``, measured on the real run)."""

    reached: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)

    def add(self, verified_per_step: list[list[int]], accepted_per_step: list[list[int]]) -> None:
        """Count one call's steps (:class:`~tetris_hf.outputs.TetrisStats` lists; ``-1``: a finished row)."""
        for verified_row, accepted_row in zip(verified_per_step, accepted_per_step):
            for verified, accepted in zip(verified_row, accepted_row):
                if verified <= 0:
                    continue
                deepest = min(verified, accepted + 1)  # positions reached: up to the first rejection
                while len(self.reached) < deepest:
                    self.reached.append(0)
                    self.accepted.append(0)
                for position in range(deepest):
                    self.reached[position] += 1
                    self.accepted[position] += position < accepted

    def rates(self) -> list[float | None]:
        return [accepted / reached if reached else None for accepted, reached in zip(self.accepted, self.reached)]


def _percentile(sorted_values: list[float], percent: float) -> float:
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * percent / 100
    low, high = math.floor(rank), math.ceil(rank)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


class StepCounter(StoppingCriteria):
    """Counts the steps of transformers' own decoding loops (plain and assisted), which check their stopping
    criteria once per target forward; stops nothing."""

    def __init__(self):
        self.count = 0

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.count += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class PeakMemory:
    """Peak memory during a run: CUDA's allocator peak on GPU, else the process RSS sampled every 20 ms (MB)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            import psutil

            process = psutil.Process()

            def sample():
                while not self._stop.is_set():
                    self.peak = max(self.peak, process.memory_info().rss / 2**20)
                    self._stop.wait(0.02)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self._stop.set()
            self._thread.join()


def generated_tokens(sequences: torch.Tensor, prompt_width: int, eos_token_ids: set[int]) -> list[list[int]]:
    """Each row's new tokens, up to and including its first EOS (what follows is padding)."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        for index, token in enumerate(row):
            if token in eos_token_ids:
                row = row[: index + 1]
                break
        rows.append(row)
    return rows


def encode(tokenizer, texts: list[str], device) -> dict:
    """Left-padded batch; rendered chats already carry their special tokens."""
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {key: value.to(device) for key, value in batch.items() if key in ("input_ids", "attention_mask")}


def _eos_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()


def run_strategy(
    name: str,
    strategy: str,
    options: dict,
    target,
    draft,
    tokenizer,
    texts: list[str],
    config: BenchConfig,
    progress=None,
) -> RunResult:
    """Run one strategy over ``texts`` in batches of ``config.batch_size`` (``hf-assisted``, ``hf-lookup``: one at a
    time). ``draft`` is None when the speculative runs draft by prompt lookup (their ``options`` say how)."""
    device = target.device
    batch_size = 1 if strategy in ONE_AT_A_TIME else config.batch_size
    eos_ids = _eos_ids(target)
    common = dict(max_new_tokens=config.max_new_tokens, do_sample=config.do_sample, pad_token_id=tokenizer.pad_token_id)
    outputs, latencies = [], []
    drafted = verified = accepted = row_steps = 0
    draft_seconds = verify_seconds = 0.0
    target_tokens = selected_tokens = lookup_verified = 0
    # acceptance by draft position needs chains: a tree row's verified count mixes depths and siblings
    trees = options.get("tetris_tree_width", 1) > 1
    positions = None if strategy in BASELINES or trees else PositionCounts()
    steps = None if strategy in BASELINES else []
    counter = StepCounter()  # (transformers' loops: one target forward a step; ours report their steps)
    baseline = dict(stopping_criteria=StoppingCriteriaList([counter]))
    torch.manual_seed(config.seed)
    with PeakMemory(device) as memory:
        started = time.perf_counter()
        for first in range(0, len(texts), batch_size):
            batch = encode(tokenizer, texts[first : first + batch_size], device)
            if strategy == "generate":
                sequences = target.generate(**batch, **common, **baseline)
            elif strategy == "hf-assisted":
                sequences = target.generate(**batch, assistant_model=draft, **common, **baseline)
            elif strategy == "hf-lookup":
                sequences = target.generate(**batch, **options, **common, **baseline)
            else:
                result = target.generate(
                    **batch, **{**drafting(draft), **options}, custom_generate="tetris", tetris_strategy=strategy,
                    return_dict_in_generate=True, **common,
                )
                sequences, stats = result.sequences, result.tetris_stats
                drafted += stats.drafted_tokens
                verified += stats.verified_tokens
                accepted += stats.accepted_tokens
                draft_seconds += stats.draft_seconds
                verify_seconds += stats.verify_seconds
                target_tokens += stats.target_tokens
                selected_tokens += stats.selected_tokens
                lookup_verified += stats.lookup_verified_tokens
                row_steps += sum(sum(v >= 0 for v in step) for step in stats.verified_per_step)
                counter.count += len(stats.verified_per_step)  # one target forward a step
                if positions is not None:
                    positions.add(stats.verified_per_step, stats.accepted_per_step)
                steps.append([[k, verified_row, accepted_row] for k, verified_row, accepted_row in zip(
                    stats.num_drafted_per_step, stats.verified_per_step, stats.accepted_per_step)])
            rows = generated_tokens(sequences, batch["input_ids"].shape[1], eos_ids)
            if strategy == "generate":
                row_steps += sum(map(len, rows))  # one token per row per step, by construction
            outputs.extend(rows)
            latencies.extend([time.perf_counter() - started] * len(rows))
            if progress is not None:
                progress.update(len(rows))
        seconds = time.perf_counter() - started
    if strategy in ONE_AT_A_TIME:
        row_steps = counter.count  # one row, one target forward per step
    return RunResult(
        name=name,
        strategy=strategy,
        options=options,
        requests=len(texts),
        tokens=sum(map(len, outputs)),
        seconds=seconds,
        latencies=latencies,
        target_forwards=counter.count,
        row_steps=row_steps,
        drafted=drafted,
        verified=verified,
        accepted=accepted,
        peak_memory_mb=memory.peak,
        outputs=outputs,
        position_counts=positions,
        steps=steps,
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
        target_tokens=target_tokens,
        selected_tokens=selected_tokens,
        lookup_verified=lookup_verified,
    )


def drafting(draft) -> dict:
    """How a speculative run drafts: with the draft model, or (``draft`` None, ``--draft lookup``) by prompt lookup,
    whose ``prompt_lookup_num_tokens`` and ``max_matching_ngram_size`` are in the run's options (a run's own
    ``assistant_model``, ``None`` in a ``--sources`` lookup run, overrides this)."""
    return {} if draft is None else {"assistant_model": draft}


def lookup_options(k: int, config: BenchConfig) -> dict:
    """Prompt-lookup drafting of ``k`` tokens after a matching n-gram of at most ``config.max_ngram`` tokens."""
    return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": config.max_ngram}


def plan_runs(config: BenchConfig, num_rows: int) -> list[tuple[str, str, dict]]:
    """``(name, strategy, generate options)`` for every run, baselines first (``hf-lookup`` once per ``k``); the
    speculative runs once per ``config.draft_vocabs`` entry (named ``... N=8192`` when the draft's head is reduced;
    ``... n=3`` when they draft by prompt lookup), and each of those once per ``config.tree_widths`` entry (named
    ``... w=3`` for draft trees of width 3)."""
    runs = []
    for strategy in BASELINES:
        if strategy not in config.strategies:
            continue
        if strategy == "hf-lookup":
            runs += [(f"hf-lookup k={k} n={config.max_ngram}", strategy, lookup_options(k, config))
                     for k in config.num_assistant_tokens]
        else:
            runs.append((strategy, strategy, {}))
    if config.lookup and config.tree_widths != (1,):
        raise ValueError("draft trees (tree_widths > 1) need a draft model or an EAGLE head: prompt lookup drafts "
                         "chains only")
    if config.lookup:
        for name, strategy, options in _speculative_runs(config, num_rows):
            k = options.pop("num_assistant_tokens")
            runs.append((f"{name} n={config.max_ngram}", strategy, {**lookup_options(k, config), **options}))
        return runs
    if config.sources != ("model",):
        return runs + _source_runs(config, num_rows)
    for vocab in config.draft_vocabs:
        for name, strategy, options in _speculative_runs(config, num_rows):
            if vocab is not None:
                name, options = f"{name} N={vocab}", {**options, "tetris_draft_vocab": vocab}
            for width in config.tree_widths:
                if width == 1:
                    runs.append((name, strategy, options))
                else:
                    runs.append((f"{name} w={width}", strategy, {**options, "tetris_tree_width": width}))
    return runs


def _source_runs(config: BenchConfig, num_rows: int) -> list[tuple[str, str, dict]]:
    """The speculative runs once per ``config.sources`` entry, source after source: ``... model`` (the draft model),
    ``... lookup n=N`` (prompt lookup, ``assistant_model=None``), ``... hybrid n=N`` (both)."""
    if config.tree_widths != (1,) or config.draft_vocabs != (None,):
        raise ValueError("--sources compares draft sources on chains with the draft's full head: leave out "
                         "--tree-width and --draft-vocab")
    runs = []
    for source in config.sources:
        for name, strategy, options in _speculative_runs(config, num_rows):
            if source == "model":
                runs.append((f"{name} model", strategy, options))
                continue
            lookup = lookup_options(options["num_assistant_tokens"], config)
            if source == "lookup":
                options = {key: value for key, value in options.items() if key != "num_assistant_tokens"}
                runs.append((f"{name} lookup n={config.max_ngram}", strategy,
                             {**lookup, **options, "assistant_model": None}))
            else:  # hybrid: k cells a row, lookup's where it matches, the model's elsewhere
                runs.append((f"{name} hybrid n={config.max_ngram}", strategy, {**options, **lookup}))
    return runs


def _speculative_runs(config: BenchConfig, num_rows: int) -> list[tuple[str, str, dict]]:
    runs = []
    for k in config.num_assistant_tokens:
        budget = config.budget if config.budget is not None else k * num_rows
        for strategy in config.strategies:
            if strategy in BASELINES:
                continue
            if strategy == "fixed":
                runs.append((f"fixed k={k}", "fixed", {"num_assistant_tokens": k}))
            elif strategy == "tetris":
                for e in config.extra_tokens:
                    options = {"num_assistant_tokens": k, "tetris_extra_tokens": e}
                    if config.budget is not None:
                        options["tetris_budget"] = config.budget
                    runs.append((f"tetris k={k} e={e} C={budget}", "tetris", options))
            else:  # adaptive, dsd: K <= k + the largest e; a given budget caps C
                extra = max(config.extra_tokens)
                options = {"num_assistant_tokens": k, "tetris_extra_tokens": extra}
                if config.budget is not None:
                    options["tetris_budget"] = config.budget
                runs.append((f"{strategy} k={k} e={extra}", strategy, options))
    if config.padded:  # the same runs on the padded verify block, to compare
        runs += [(f"{name} padded", strategy, {**options, "tetris_pack": False}) for name, strategy, options in runs]
    threshold = config.confidence_threshold
    if threshold is not None and not config.lookup:  # the same runs with chains stopped where the draft is unsure
        runs += [(f"{name} stop<{threshold:g}", strategy, {**options, "tetris_confidence_threshold": threshold})
                 for name, strategy, options in runs]
    return runs


def profile_cost_model(target, draft, runs: list[tuple[str, str, dict]], num_rows: int) -> float | None:
    """Measure (or load) the cost profiles ``adaptive`` and ``dsd`` use (one per draft vocabulary; with ``draft`` None,
    prompt lookup, the target's alone), before any timing; their seconds, or ``None`` when no run needs one. Each is
    measured once per pair, device, dtype and thread count and then cached."""
    from ..candidate_generators.reduced_vocab import reduced_vocab_draft
    from ..cost_model import cost_model_for

    windows: dict = {}
    for _, strategy, options in runs:
        if strategy in ("adaptive", "dsd"):
            # (a --sources lookup run drafts without the model: the target's profile alone)
            key = options.get("tetris_draft_vocab"), options.get("assistant_model", True) is not None
            k = options.get("num_assistant_tokens", options.get("prompt_lookup_num_tokens"))
            window = k + options.get("tetris_extra_tokens", 0)
            windows[key] = max(window, windows.get(key, 0))
    if not windows:
        return None
    started = time.perf_counter()
    for (vocab, drafts), window in windows.items():
        drafter = None if draft is None or not drafts else reduced_vocab_draft(draft, vocab)
        cost_model_for(target, drafter, num_rows=num_rows, max_tokens=window + 1)
    return time.perf_counter() - started


def draft_cost_ratios(target, draft, vocabs, rows: list[int], rounds: int = 5) -> list[dict]:
    """One draft step against one target step (both one token per row, on a 32-token cache) for each draft vocabulary
    and row count: ``[{vocab, rows, draft_ms, target_ms, ratio}]``. ``rounds`` rounds, each timing every vocabulary's
    draft and the target in turn (3 forwards each), so that a busy spell of a shared machine hits all of them; each
    time is the fastest over all rounds."""
    from ..candidate_generators.reduced_vocab import reduced_vocab_draft
    from ..cost_model import measure_profile

    fastest: dict[tuple, float] = {}
    for _ in range(rounds):
        for vocab in vocabs:
            profile = measure_profile(target, reduced_vocab_draft(draft, vocab), rows=rows, tokens=[1], repeats=3)
            for r in rows:
                for key, ms in (((vocab, r, "draft"), profile.draft[r]), ((vocab, r, "target"), profile.target[(r, 1)])):
                    fastest[key] = min(ms, fastest.get(key, math.inf))
    results = []
    for vocab in vocabs:
        for r in rows:
            draft_ms, target_ms = fastest[(vocab, r, "draft")], fastest[(vocab, r, "target")]
            results.append({"vocab": vocab, "rows": r, "draft_ms": draft_ms, "target_ms": target_ms,
                            "ratio": draft_ms / target_ms})
    return results


def median_run(results: list[RunResult]) -> RunResult:
    """The repeat with the median time (the lower middle one for an even count), with every repeat's seconds."""
    ordered = sorted(results, key=lambda result: result.seconds)
    median = ordered[(len(ordered) - 1) // 2]
    return dataclasses.replace(median, repeat_seconds=[result.seconds for result in results])


def check_greedy_outputs(results: list[RunResult], target, tokenizer, texts: list[str]) -> list[str]:
    """Greedy outputs of every run must equal plain ``generate()``'s; returns one line per run that fails.

    A differing row fails only when it first differs where the target's choice was clear (re-scored by ``target`` on
    the prompt of ``texts[row]``): in bf16/fp16 a block forward and a one-token forward round differently, so outputs
    may differ at near-ties (:mod:`tetris_hf.tools.divergence` states the tolerance; in fp32 it is 0). Each run's
    ``agreement["divergences"]`` lists its differing rows.
    """
    reference = next((r for r in results if r.strategy == "generate"), None)
    if reference is None:
        return []
    from .divergence import compare_outputs
    from .metrics import load_output_agreement

    metric = load_output_agreement()
    problems = []
    for result in results:
        pairs = [(o, ref) for o, ref in zip(result.outputs, reference.outputs) if o is not None]
        agreement = metric.compute(predictions=[p for p, _ in pairs], references=[r for _, r in pairs])
        result.agreement = agreement
        if agreement["exact_match"] == 1.0:
            continue
        rows = [i for i, (o, ref) in enumerate(zip(result.outputs, reference.outputs)) if o is not None and o != ref]
        prompts = [tokenizer(texts[i], add_special_tokens=False)["input_ids"] for i in rows]
        checks = compare_outputs(target, prompts, [result.outputs[i] for i in rows],
                                 [reference.outputs[i] for i in rows])
        agreement["divergences"] = [dict(dataclasses.asdict(check), row=i) for i, check in zip(rows, checks)]
        failing = sum(not check.within_tolerance for check in checks)
        if failing:
            problems.append(
                f"{result.name}: {agreement['exact_match']:.0%} of outputs equal plain generate "
                f"(token agreement {agreement['token_agreement']:.3f}; {failing} differ beyond a near-tie)"
            )
    return problems


def format_table(summaries: list[dict], reference_name: str | None) -> str:
    reference = next((s for s in summaries if s["name"] == reference_name), None)
    spread = any(len(s.get("tokens_per_second_repeats", [])) > 1 for s in summaries)
    # lookup's share of the verified cells, where runs draft from different sources (--sources)
    shares = {s.get("lookup_share_of_verified") for s in summaries} - {None}
    by_source = bool(shares - {0.0, 1.0}) or {0.0, 1.0} <= shares
    width = max([26] + [len(s["name"]) for s in summaries])
    header = (f"{'strategy':<{width}} {'tok/s':>7} {'x plain':>7} {'lat mean':>8} {'p50':>6} {'p99':>6} "
              f"{'accept':>6} {'VSR':>5} {'fwd/tok':>7} {'tok/step':>8} {'tok/node':>8} {'comp/sel':>8} "
              f"{'peak MB':>8}" + (f" {'lookup':>6}" if by_source else "")
              + (f" {'tok/s min-max':>14}" if spread else ""))
    lines = [header, "-" * len(header)]
    for s in summaries:
        ratio = s["tokens_per_second"] / reference["tokens_per_second"] if reference else float("nan")
        fmt = lambda value: f"{value:.2f}" if value is not None else "-"  # noqa: E731
        lines.append(
            f"{s['name']:<{width}} {s['tokens_per_second']:>7.1f} {ratio:>7.2f} {s['latency_mean_s']:>8.1f} "
            f"{s['latency_p50_s']:>6.1f} {s['latency_p99_s']:>6.1f} {fmt(s['acceptance_rate']):>6} "
            f"{fmt(s['vsr']):>5} {s['target_forwards_per_token']:>7.3f} {s['tokens_per_row_step']:>8.2f} "
            f"{fmt(s.get('tokens_per_verified_node')):>8} {fmt(s.get('computed_per_selected')):>8} "
            f"{s['peak_memory_mb']:>8.0f}" + (f" {fmt(s.get('lookup_share_of_verified')):>6}" if by_source else "")
            + (f" {_range(s['tokens_per_second_repeats']):>14}" if spread else "")
        )
    return "\n".join(lines)


def format_draft_costs(costs: list[dict]) -> str:
    """One line per draft vocabulary: its step time against a target step at each measured row count."""
    lines = ["draft step / target step (one token per row, fastest of 5 interleaved rounds):"]
    for vocab in dict.fromkeys(c["vocab"] for c in costs):
        cells = [f"B={c['rows']}: {c['draft_ms']:.1f} / {c['target_ms']:.1f} ms = {c['ratio']:.3f}"
                 for c in costs if c["vocab"] == vocab]
        lines.append(f"  {'full vocabulary' if vocab is None else f'N={vocab}':<16} " + ", ".join(cells))
    return "\n".join(lines)


def _range(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def plot(summaries: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["name"] for s in summaries]
    colours = ["#9e9e9e" if s["strategy"] in BASELINES else "#1f77b4" if s["strategy"] == "fixed"
               else "#d62728" if s["strategy"] == "tetris" else "#2ca02c" for s in summaries]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 0.45 * len(names) + 2), sharey=True)
    positions = range(len(names))
    left.barh(positions, [s["tokens_per_second"] for s in summaries], color=colours)
    left.set_xlabel("output tokens / s (higher is better)")
    left.set_yticks(list(positions), names)
    left.invert_yaxis()
    right.barh(positions, [s["vsr"] or 0.0 for s in summaries], color=colours)
    right.set_xlabel("VSR: accepted / verified draft tokens")
    right.set_xlim(0, 1)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def distributed_state(device: torch.device):
    """Under ``accelerate launch`` with several processes: accelerate's ``PartialState`` (gloo on CPU), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=device.type == "cpu")


def _split_for_processes(texts: list[str], state) -> tuple[list[str], list[int]]:
    """This process's share of the prompts, and their indices in the full list."""
    indices = list(range(len(texts)))
    if state is None:
        return texts, indices
    with state.split_between_processes(indices) as mine:
        mine = list(mine)
    return [texts[i] for i in mine], mine


def _gather(result: RunResult, indices: list[int]) -> RunResult:
    """Combine one run's per-process results: tokens add up, wall time is the slowest process's."""
    from accelerate.utils import gather_object

    parts = gather_object([(dataclasses.asdict(result), list(indices))])
    merged = dataclasses.asdict(result)
    outputs = {}
    for part, part_indices in parts:
        outputs.update(zip(part_indices, part["outputs"]))
    for key in ("requests", "tokens", "target_forwards", "row_steps", "drafted", "verified", "accepted",
                "draft_seconds", "verify_seconds", "target_tokens", "selected_tokens", "lookup_verified"):
        merged[key] = sum(part[key] for part, _ in parts)
    merged["seconds"] = max(part["seconds"] for part, _ in parts)
    merged["peak_memory_mb"] = max(part["peak_memory_mb"] for part, _ in parts)
    merged["latencies"] = [latency for part, _ in parts for latency in part["latencies"]]
    merged["outputs"] = [outputs[i] for i in sorted(outputs)]
    if result.position_counts is not None:
        depth = max(len(part["position_counts"]["reached"]) for part, _ in parts)
        merged["position_counts"] = PositionCounts(
            *([sum(_padded(part["position_counts"][key], depth)[i] for part, _ in parts) for i in range(depth)]
              for key in ("reached", "accepted")))
    if result.steps is not None:  # each process's steps, its own rows (their numbering restarts per process)
        merged["steps"] = [step for part, _ in parts for step in part["steps"]]
    return RunResult(**merged)


def _padded(values: list[int], length: int) -> list[int]:
    return values + [0] * (length - len(values))


def run_bench(
    target, draft, tokenizer, texts: list[str], config: BenchConfig, *, show_progress: bool = True, state=None
) -> dict:
    """Every planned run on ``texts``; returns ``{"config", "runs": [summary...], "mismatches": [...]}``.

    ``draft`` is None with ``config.lookup`` (the speculative runs draft by prompt lookup); it is needed otherwise.

    With an accelerate ``state`` (several processes), each process runs its share of the prompts and the results are
    gathered: tokens add up, wall time is the slowest process's.
    """
    from tqdm.auto import tqdm

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    all_texts = texts  # the greedy check re-scores differing rows, which may come from any process
    texts, indices = _split_for_processes(texts, state)
    is_main = state is None or state.is_main_process
    if (draft is None) != config.lookup:
        raise ValueError("run_bench needs a draft model, or draft=None with config.lookup (prompt lookup)")
    runs = plan_runs(config, min(config.batch_size, len(texts)))
    assisted_texts = texts[: config.hf_assisted_prompts]
    # Warm-up: the first forwards of a process are slow (allocator, kernels); keep them out of every timing, and so
    # are building and checking each reduced-vocabulary draft (cached on the draft).
    from ..candidate_generators.reduced_vocab import reduced_vocab_draft

    if draft is not None:
        for vocab in config.draft_vocabs:
            reduced_vocab_draft(draft, vocab)
    warm = encode(tokenizer, texts[:2], target.device)
    target.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if draft is not None:  # warms the draft too (hf-assisted uses it)
        target.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                        assistant_model=draft, custom_generate="tetris")
    if (draft is None or config.sources != ("model",)) and any(strategy not in BASELINES for _, strategy, _ in runs):
        target.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                        custom_generate="tetris", **lookup_options(1, config))
    profile_seconds = profile_cost_model(target, draft, runs, min(config.batch_size, len(texts)))
    cost_rows = sorted({1, min(config.batch_size, len(texts))})
    measure_draft = is_main and draft is not None
    draft_costs = draft_cost_ratios(target, draft, config.draft_vocabs, cost_rows) if measure_draft else []
    total = config.repeats * sum(len(assisted_texts) if strategy == "hf-assisted" else len(texts)
                                 for _, strategy, _ in runs)
    repeats: dict[str, list[RunResult]] = {name: [] for name, _, _ in runs}
    with tqdm(total=total, desc="bench", unit="req", disable=not (show_progress and is_main), file=sys.stderr) as bar:
        for _ in range(config.repeats):  # interleaved, so that a slow spell of the machine hits every strategy
            for name, strategy, options in runs:
                bar.set_postfix_str(name)
                run_texts = assisted_texts if strategy == "hf-assisted" else texts
                result = run_strategy(name, strategy, options, target, draft, tokenizer, run_texts, config, bar)
                if strategy == "hf-assisted":
                    result.outputs += [None] * (len(texts) - len(run_texts))
                if state is not None:
                    result = _gather(result, indices)
                repeats[name].append(result)
    results = [median_run(repeats[name]) for name, _, _ in runs]
    mismatches = check_greedy_outputs(results, target, tokenizer, all_texts) if not config.do_sample else []
    step_traces = [{"run": r.name, "strategy": r.strategy, "options": r.options,
                    "tree_width": r.options.get("tetris_tree_width", 1), "batch_size": config.batch_size,
                    "calls": r.steps} for r in results if r.steps is not None]
    return {"config": dataclasses.asdict(config), "runs": [result.summary() for result in results],
            "mismatches": mismatches, "cost_profile_seconds": profile_seconds, "draft_cost": draft_costs,
            "is_main_process": is_main, "num_processes": 1 if state is None else state.num_processes,
            "step_traces": step_traces}


# ---------------------------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="sharegpt",
                        help="sharegpt | mtbench | humaneval | humaneval-edit | sharegpt-summarize | mixed | "
                             "extraction | FILE.jsonl (humaneval-edit and sharegpt-summarize are grounded: answers "
                             "that copy the prompt; extraction: answers of one JSON shape across requests)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-prompt-tokens", type=int, default=256,
                        help="skip prompts longer than this many tokens (ShareGPT has some very long ones)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--strategies", default=None,
                        help="comma list: generate, hf-assisted, hf-lookup (transformers' prompt lookup, one request "
                             f"at a time, every prompt), fixed, tetris, or any other tetris_strategy (default "
                             f"{DEFAULT_STRATEGIES}; with --draft lookup {DEFAULT_STRATEGIES_LOOKUP}; with an EAGLE "
                             f"head {DEFAULT_STRATEGIES_EAGLE})")
    parser.add_argument("--num-assistant-tokens", type=number_list(int, 1), default=(4,), help="k (comma list)")
    parser.add_argument("--extra-tokens", type=number_list(int, 0), default=(1, 2, 3), help="TETRIS e (comma list)")
    parser.add_argument("--budget", type=int, default=None, help="C per step (default k x batch size)")
    parser.add_argument("--padded", action="store_true",
                        help="also run every speculative run with the padded verify block (tetris_pack=False), to "
                             "compare with the packed one")
    parser.add_argument("--confidence-threshold", type=float, default=None,
                        help="also run every speculative run with tetris_confidence_threshold=X (a chain stops once "
                             "every row's draft is less sure than X; transformers' assisted generation uses 0.4), "
                             "named '... stop<X'")
    parser.add_argument("--sources", default="model",
                        help="comma list of draft sources, each speculative run once per source: model (the draft "
                             "model or EAGLE head), lookup (prompt lookup alone), hybrid (both: lookup where a row "
                             "matches, the model elsewhere); default model")
    parser.add_argument("--hf-assisted-prompts", type=int, default=4,
                        help="requests for transformers' one-at-a-time assisted generation (it is slow)")
    parser.add_argument("--target", default=None, help="Hub id, local directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--draft", default=None,
                        help="Hub id, local directory, tetris-hf draft directory, early-exit:N, 'eagle' (the EAGLE "
                             "head shipped for the default target), eagle:PATH_OR_REPO (a published EAGLE-1/3 head), "
                             "or 'lookup' (the speculative runs draft by prompt lookup, k = --num-assistant-tokens; "
                             "default: the shipped draft model)")
    parser.add_argument("--max-ngram", type=int, default=3,
                        help="longest n-gram prompt lookup matches (max_matching_ngram_size), for --draft lookup and "
                             "hf-lookup (default 3)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy (no equality check)")
    parser.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes nf4 target")
    parser.add_argument("--load-in-8bit", action="store_true", help="bitsandbytes 8-bit target")
    parser.add_argument("--output", default="bench-out", help="directory for results.json and bench.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every strategy this many times, interleaved, and report the median run")
    parser.add_argument("--draft-vocab", type=draft_vocab_list, default=(None,),
                        help="comma list of draft head sizes: 'full' or N (the draft's N most frequent tokens, "
                             "tetris_draft_vocab=N); every speculative run is repeated for each (default: full)")
    parser.add_argument("--tree-width", type=number_list(int, 1), default=(1,),
                        help="comma list of draft tree widths (tetris_tree_width): every speculative run is repeated "
                             "for each width > 1, named '... w=W', at the same k, e and budget (default 1: chains)")
    parser.add_argument("--no-progress", action="store_true")
    add_kernel_argument(parser)


def draft_vocab_list(text: str) -> tuple[int | None, ...]:
    """argparse type of ``--draft-vocab``: ``full`` -> None, else positive ints."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if part == "full":
            values.append(None)
        elif part.isdigit() and int(part) > 0:
            values.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"expected 'full' or a positive number of tokens, got {part!r}")
    if not values:
        raise argparse.ArgumentTypeError("expected at least one draft vocabulary")
    return tuple(dict.fromkeys(values))


def ensure_token_counts(draft, tokenizer, vocabs) -> str | None:
    """A reduced head needs the draft's token frequency table; a draft that ships none gets one counted over the
    last 2,000 ShareGPT chats (``data.SHAREGPT_RESERVED_TAIL``: no prompt set for measurement reads them). Returns
    where the table came from."""
    from ..candidate_generators.reduced_vocab import (
        TOKEN_COUNTS_ATTRIBUTE, TOKEN_COUNTS_SOURCE_ATTRIBUTE, attach_token_counts, token_counts,
    )
    from ..checks import output_vocab_size

    if all(vocab is None for vocab in vocabs):
        return None
    if getattr(draft, TOKEN_COUNTS_ATTRIBUTE, None) is None:
        from .data import sharegpt_fitting_chats

        chats, _ = sharegpt_fitting_chats()
        texts = [tokenizer.apply_chat_template(list(chat.messages), tokenize=False) for chat in chats]
        counts = token_counts(tokenizer, texts, output_vocab_size(draft))
        attach_token_counts(draft, counts, f"{int(counts.sum()):,} tokens of the last {len(chats)} ShareGPT chats "
                                           "(counted by the bench: the draft ships no table)")
    vocab = output_vocab_size(draft)
    too_big = [v for v in vocabs if v is not None and v > vocab]
    if too_big:
        raise UsageError(f"--draft-vocab {too_big[0]} is larger than the draft's {vocab}-token vocabulary")
    return getattr(draft, TOKEN_COUNTS_SOURCE_ATTRIBUTE)


def config_from_args(args) -> BenchConfig:
    for flag in ("num_prompts", "batch_size", "max_new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.budget is not None and args.budget < 0:
        raise UsageError(f"--budget must be >= 0, got {args.budget}")
    from .models import is_eagle_name

    eagle = args.draft is not None and is_eagle_name(args.draft)
    lookup = args.draft == "lookup"
    default = DEFAULT_STRATEGIES_LOOKUP if lookup else DEFAULT_STRATEGIES_EAGLE if eagle else DEFAULT_STRATEGIES
    strategies = tuple(s.strip() for s in (args.strategies or default).split(",") if s.strip())
    from ..options import STRATEGIES

    unknown = [s for s in strategies if s not in BASELINES and s not in STRATEGIES]
    if unknown or not strategies:
        raise UsageError(f"unknown strategy {unknown}: choose from {', '.join(BASELINES + tuple(STRATEGIES))}")
    if args.max_ngram < 1:
        raise UsageError(f"--max-ngram must be at least 1, got {args.max_ngram}")
    if lookup and "hf-assisted" in strategies:
        raise UsageError("hf-assisted needs a draft model, and --draft lookup has none: use hf-lookup")
    if lookup and args.draft_vocab != (None,):
        raise UsageError("--draft-vocab reduces a draft model's head, and --draft lookup has none")
    sources = tuple(dict.fromkeys(source.strip() for source in args.sources.split(",") if source.strip()))
    if not sources or any(source not in SOURCES for source in sources):
        raise UsageError(f"--sources takes a comma list of {', '.join(SOURCES)}, got {args.sources!r}")
    threshold = args.confidence_threshold
    if threshold is not None and (lookup or sources != ("model",) or args.tree_width != (1,) or not 0 < threshold < 1):
        raise UsageError("--confidence-threshold takes a number in (0, 1) and stops a model's chains: not with "
                         "--draft lookup, --sources or --tree-width")
    if lookup and sources != ("model",):
        raise UsageError("--sources needs a draft model or an EAGLE head (--draft lookup drafts by lookup alone)")
    if sources != ("model",) and (args.tree_width != (1,) or args.draft_vocab != (None,)):
        raise UsageError("--sources compares draft sources on chains with the draft's full head: leave out "
                         "--tree-width and --draft-vocab")
    if lookup and args.tree_width != (1,):
        raise UsageError("--tree-width grows draft trees with a draft model or an EAGLE head; --draft lookup drafts "
                         "one continuation per row (use --tree-width 1)")
    if eagle:
        if "hf-assisted" in strategies:
            raise UsageError("hf-assisted cannot run an EAGLE head (transformers' assisted generation takes a draft "
                             "model); leave hf-assisted out of --strategies with --draft eagle")
        if args.draft_vocab != (None,):
            raise UsageError("--draft-vocab reduces a draft model's head; an EAGLE head has its own draft vocabulary")
    return BenchConfig(
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        strategies=strategies,
        num_assistant_tokens=args.num_assistant_tokens,
        extra_tokens=args.extra_tokens,
        budget=args.budget,
        hf_assisted_prompts=args.hf_assisted_prompts,
        do_sample=args.do_sample,
        seed=args.seed,
        repeats=args.repeats,
        draft_vocabs=args.draft_vocab,
        lookup=lookup,
        max_ngram=args.max_ngram,
        tree_widths=tuple(dict.fromkeys(args.tree_width)),
        padded=args.padded,
        sources=sources,
        confidence_threshold=threshold,
    )


STEP_TRACE_FORMAT = "tetris-hf-step-trace"
STEP_TRACE_VERSION = 1


def write_step_traces(path: Path, runs: list[dict], header: dict) -> Path:
    """JSONL: a header line ``{"format": "tetris-hf-step-trace", ...}``, then one line per speculative run:
    ``{"run", "strategy", "options", "tree_width", "batch_size", "calls"}``, ``calls[c][s] = [K, verified,
    accepted]``: step ``s`` of ``generate()`` call ``c`` drafted ``K`` levels, and row ``r`` verified ``verified[r]``
    draft tokens (tree nodes) and accepted ``accepted[r]`` of them (``-1``: the row had finished; a call's first step
    reads the prompt, ``K = 0``).
    :func:`tetris_hf.tools.simulate.read_step_traces` reads it."""
    with path.open("w") as out:
        out.write(json.dumps({"format": STEP_TRACE_FORMAT, "version": STEP_TRACE_VERSION, **header}) + "\n")
        for run in runs:
            out.write(json.dumps(run, separators=(",", ":")) + "\n")
    return path


def load_lookup_target(name: str | None, device, quantization, max_ngram: int):
    """``--draft lookup``: the target alone, and a :class:`~tetris_hf.tools.models.PairInfo` whose draft is prompt
    lookup."""
    from .models import ModelNotFoundError, PairInfo, load_target

    started = time.perf_counter()
    try:
        target, tokenizer = load_target(name, device=device, quantization_config=quantization)
    except (ModelNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from None
    info = PairInfo(target=target.tetris_description, draft=f"prompt lookup (n-grams of at most {max_ngram} tokens "
                    "in each row's own prompt and output)", draft_kind="lookup", seconds=time.perf_counter() - started)
    return target, tokenizer, info


def main(args) -> int:
    config = config_from_args(args)
    if not config.do_sample:  # greedy outputs are checked by the shipped metric after the runs: a missing one fails now
        from .metrics import output_agreement_path

        try:
            output_agreement_path()
        except FileNotFoundError as error:
            raise UsageError(str(error)) from None
    device = resolve_device(args.device)
    prompt_set = load_prompt_set(args.prompts)
    state = distributed_state(device)
    if state is not None and device.type == "cuda":
        device = state.device  # one GPU per process
    torch.manual_seed(args.seed)
    quantization = None
    if args.load_in_4bit or args.load_in_8bit:
        from ..quantization import quantization_config

        try:
            quantization = quantization_config(args.load_in_4bit, args.load_in_8bit, device=device)
        except (ValueError, ImportError, RuntimeError) as error:
            raise UsageError(str(error)) from None
    if config.lookup:
        target, tokenizer, info = load_lookup_target(args.target, device, quantization, config.max_ngram)
        draft = None
    else:
        target, draft, tokenizer, info = load_pair(args.target, args.draft, device, quantization)
    kernels = apply_kernels(args, target, draft)
    print(kernels, flush=True)
    texts, note = prompt_texts(prompt_set, args.num_prompts, tokenizer, args.max_prompt_tokens)
    vocab_source = ensure_token_counts(draft, tokenizer, config.draft_vocabs)
    report = run_bench(target, draft, tokenizer, texts, config, show_progress=not args.no_progress, state=state)
    if not report["is_main_process"]:
        return 0
    report.update(pair=dataclasses.asdict(info), prompts={"set": args.prompts, "count": len(texts), "note": note},
                  draft_vocab_source=vocab_source, kernels=kernels,
                  device=str(device), torch=torch.__version__, threads=torch.get_num_threads(),
                  argv=sys.argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    step_traces = report.pop("step_traces")
    (output / "results.json").write_text(json.dumps(report, indent=2))
    write_step_traces(output / "step-traces.jsonl", step_traces,
                      {"target": info.target, "draft": info.draft, "prompts": args.prompts, "num_prompts": len(texts),
                       "max_new_tokens": config.max_new_tokens, "do_sample": config.do_sample, "device": str(device)})
    title = (f"{args.prompts} x{len(texts)}, batch {config.batch_size}, {config.max_new_tokens} new tokens, "
             f"{device} — draft: {info.draft_kind}")
    plot(report["runs"], output / "bench.png", title)
    print(f"target: {info.target}\ndraft:  {info.draft}\nprompts: {note}")
    if vocab_source is not None:
        print(f"reduced draft heads (N=...): the N most frequent tokens of {vocab_source}")
    print(format_table(report["runs"], "generate" if "generate" in config.strategies else None))
    if report["draft_cost"]:
        print(format_draft_costs(report["draft_cost"]))
    if report["cost_profile_seconds"] is not None:
        print(f"cost profile for adaptive/dsd: {report['cost_profile_seconds']:.1f} s before the timed runs (measured "
              "once per pair, device, dtype and thread count, then read from the cache)")
    print(f"wrote {output / 'results.json'}, {output / 'bench.png'} and {output / 'step-traces.jsonl'}")
    for run in report["runs"]:
        for divergence in (run["agreement_with_generate"] or {}).get("divergences", []):
            print(f"{run['name']}: {RowDivergence(**divergence).describe()}")
    if report["mismatches"]:
        print("error: greedy speculative outputs differ from plain generate():", file=sys.stderr)
        for line in report["mismatches"]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from .cli import main as cli_main

    sys.exit(cli_main(["bench", *sys.argv[1:]]))
