"""``tetris-hf stream-bench``: a stream of requests, served four ways side by side in one process.

Every request arrives at time 0 (a backlog, as a batch job or a burst of traffic sees it), with its own prompt, up to
``--max-new-tokens`` new tokens, ending at EOS. The runs, on the same requests and the same target:

- ``hf-generate-batch``: transformers' own continuous batching (``model.generate_batch``, no speculation), at most
  ``--max-batch-size`` requests a batch;
- ``generate-chunks``: static ``generate()`` on chunks of ``--max-batch-size`` requests, one after the other (each
  chunk waits for its longest row);
- ``tetris-chunks``: static TETRIS ``generate(custom_generate="tetris")`` on the same chunks;
- ``stream-STRATEGY``: :func:`tetris_hf.generate_batch`, rows joining as others finish, for each ``--strategies``,
  ``tetris_compile`` at its default (``None``: eager until its steps would have paid for a compile,
  :mod:`tetris_hf.compile_choice`) or, with ``--compiled``, ``False``;
- ``stream-STRATEGY-apart`` (``--prompts-apart``): the same with every joining prompt read in forwards of its own,
  not in the verification forwards (``ride_prompts=False``).
- ``stream-STRATEGY-compiled`` (``--compiled``): the same strategy with ``tetris_compile=True``; its first run, which
  compiles, is run once before the timed repeats and reported apart (seconds and compiled graphs), never counted in
  tokens/s.
- ``vllm`` and ``vllm-ngram`` (asked for in ``--systems``): vLLM's CPU engine in a venv of its own
  (``--vllm-python`` or ``$TETRIS_HF_VLLM_PYTHON``; :mod:`tetris_hf.tools.vllm_system`), without speculation and with
  its n-gram lookup at the same k, on the same token ids, end tokens, max rows and threads, prefix caching off. Its
  engine start-up (an inductor compile) and a warm-up on the same prompts (two new tokens each) are reported apart,
  never counted in tokens/s. Without a usable vLLM python the
  run says so in one line and goes on with the other systems.

The speculative runs draft with a draft model (``--draft``), prompt lookup (``--draft lookup``), both (``--hybrid``)
or suffix drafts (``--draft suffix``: each run with a fresh cache of its own, seeded from ``--suffix-seed FILE`` when
given: earlier outputs as JSON lines, one JSON array of token ids a line; ``--tree-width W``: as trees of ``W``
children a node).

Per run: output tokens/s, requests/s, time to first token and per-token latency (p50 / p99 over requests; per-token
latency is a request's time from its first to its last token over the tokens between), the mean live rows a step,
and whether every output equals plain ``generate()``'s (static chunks', or without them ``generate_batch``'s).
``--repeats N`` runs every system N times in turn (the median is reported, with the range). Writes ``results.json``
and ``stream.png`` (live rows and tokens out over time, one line per run).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from ..options import TetrisOptions
from .allocator import allocator_note, loaded_allocator
from .cli import (UsageError, add_kernel_argument, apply_kernels, load_pair, load_prompt_set, number_list,
                  prompt_texts, resolve_device)
from .vllm_system import VLLM_SYSTEMS, VLLMSettings, is_vllm_system

SYSTEMS = ("hf-generate-batch", "generate-chunks", "tetris-chunks")
OPTIONAL_SYSTEMS = VLLM_SYSTEMS  # asked for by name in --systems, never run by default


@dataclasses.dataclass
class StreamRun:
    """One run: when each request got its first and last token (seconds from the start), its tokens, and the live
    rows over time ``(seconds, rows)``."""

    name: str
    seconds: float
    first_token: list[float]
    finished: list[float]
    tokens: list[list[int]]
    occupancy: list[tuple[float, int]]
    tokens_per_row_step: float | None = None  # speculative runs: tokens emitted per row and step
    acceptance: float | None = None  # speculative runs: drafts accepted / drafted
    lookup_share: float | None = None  # hybrid runs: the share of verified drafts that lookup drafted

    def summary(self) -> dict:
        total = sum(len(tokens) for tokens in self.tokens)
        per_token = sorted((end - first) / (len(tokens) - 1) for first, end, tokens in
                           zip(self.first_token, self.finished, self.tokens) if len(tokens) > 1)
        first = sorted(self.first_token)
        live = [rows for _, rows in self.occupancy]
        return {
            "name": self.name, "seconds": self.seconds, "tokens": total, "tokens_per_second": total / self.seconds,
            "requests_per_second": len(self.tokens) / self.seconds,
            "ttft_p50": _percentile(first, 50), "ttft_p99": _percentile(first, 99),
            "per_token_p50": _percentile(per_token, 50), "per_token_p99": _percentile(per_token, 99),
            "mean_live_rows": statistics.fmean(live) if live else None,  # (generate_batch does not say)
            "tokens_per_row_step": self.tokens_per_row_step, "acceptance": self.acceptance,
            "lookup_share": self.lookup_share,
        }


def _percentile(values: list[float], percent: float) -> float:
    if not values:
        return 0.0
    index = min(len(values) - 1, max(0, round(percent / 100 * (len(values) - 1))))
    return values[index]


class _TokenClock:
    """A stopping criterion that never stops anything: it notes when each of ``generate()``'s tokens came out, and
    how many rows were still running."""

    def __init__(self, start: float, eos: set[int]):
        self.start, self.eos, self.times, self.live = start, eos, [], []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter() - self.start)
        last = input_ids[:, -1].tolist()
        self.live.append(sum(token not in self.eos for token in last))  # rows that just ended still count once
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    """A generated row up to and including its first end token (what a static batch pads after it dropped)."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens


def run_chunks(name: str, target, prompts: list[list[int]], max_new_tokens: int, batch_size: int, eos: set[int],
               pad: int, **generate_kwargs) -> StreamRun:
    """Static ``generate()`` on consecutive chunks of ``batch_size`` prompts (left-padded)."""
    from transformers import StoppingCriteriaList

    start = time.perf_counter()
    first, finished, outputs, occupancy = [], [], [], []
    speculative = generate_kwargs.get("custom_generate") == "tetris"
    for chunk_start in range(0, len(prompts), batch_size):
        chunk = prompts[chunk_start : chunk_start + batch_size]
        width = max(len(prompt) for prompt in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=target.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=target.device)
        clock = _TokenClock(start, eos)
        steps: list[tuple[float, int]] = []
        kwargs = dict(generate_kwargs)
        if speculative:
            kwargs["tetris_step_callback"] = lambda record, loop: steps.append((time.perf_counter() - start,
                                                                                  loop.batch.num_rows))
        else:
            kwargs["stopping_criteria"] = StoppingCriteriaList([clock])
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad, **kwargs)
        done = time.perf_counter() - start
        rows = [_cut(row, eos) for row in out[:, width:].tolist()]
        outputs.extend(rows)
        if speculative:  # a row's first token comes with the chunk's first step; its last, at the chunk's end
            first.extend([steps[0][0] if steps else done] * len(rows))
            finished.extend([done] * len(rows))
            occupancy.extend(steps)
        else:  # generate() emits one token per row per call: a row's n-th token came at call n
            first.extend([clock.times[0]] * len(rows))
            finished.extend(clock.times[len(row) - 1] if row else done for row in rows)
            occupancy.extend(zip(clock.times, clock.live))
    return StreamRun(name, time.perf_counter() - start, first, finished, outputs, occupancy)


def run_hf_generate_batch(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int, eos: set[int],
                          pad: int) -> StreamRun:
    """transformers' ``generate_batch`` (continuous batching, no speculation)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos),
                              pad_token_id=pad)
    # Its paged cache sized for these requests (left to itself it takes a share of the machine's memory, which on a
    # CPU costs seconds to allocate): every row at its longest, 256 tokens a page.
    pages = batch_size * -(-(max(map(len, prompts)) + max_new_tokens) // 256) + batch_size
    batching = ContinuousBatchingConfig(max_requests_per_batch=batch_size, num_blocks=pages, max_batch_tokens=512)
    start = time.perf_counter()
    results = target.generate_batch(prompts, generation_config=config, record_timestamps=True, warmup=False,
                                    continuous_batching_config=batching)
    seconds = time.perf_counter() - start
    outputs = list(results.values())
    for output in outputs:
        if output.error:
            raise RuntimeError(f"transformers' generate_batch failed a request: {output.error}")
    first = [(output.timestamps[0] if output.timestamps else output.lifespan[1]) - start for output in outputs]
    finished = [output.lifespan[1] - start for output in outputs]
    tokens = [_cut(list(output.generated_tokens), eos) for output in outputs]
    return StreamRun("hf-generate-batch", seconds, first, finished, tokens, [])


def run_stream(name: str, target, prompts: list[list[int]], max_new_tokens: int, batch_size: int, eos: set[int],
               pad: int, **options) -> StreamRun:
    """The request stream (what :func:`tetris_hf.generate_batch` runs): rows join as others finish."""
    from ..stream import RequestStream

    occupancy: list[tuple[float, int]] = []
    row_steps = [0]
    start = time.perf_counter()

    def on_step(record, loop):
        occupancy.append((time.perf_counter() - start, loop.batch.num_rows))
        row_steps[0] += record.rows.numel()

    stream = RequestStream(target, max_batch_size=batch_size, max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=sorted(eos), pad_token_id=pad, tetris_step_callback=on_step, **options)
    ids = [stream.add(prompt, request_id=f"req_{index}") for index, prompt in enumerate(prompts)]
    try:
        outputs = {output.request_id: output for output in stream.run()}
        stats = stream.loop.stats
    finally:
        stream.close()
    seconds = time.perf_counter() - start
    outputs = [outputs[request_id] for request_id in ids]
    for output in outputs:
        if output.error:
            raise RuntimeError(f"the stream failed a request: {output.error}")
    first = [output.first_token_time - start for output in outputs]
    finished = [output.lifespan[1] - start for output in outputs]
    tokens = [_cut(list(output.generated_tokens), eos) for output in outputs]
    lookup_share = (stats.lookup_verified_tokens / stats.verified_tokens
                    if "assistant_model" in options and options.get("prompt_lookup_num_tokens") and stats.verified_tokens
                    else None)
    return StreamRun(name, seconds, first, finished, tokens, occupancy,
                     sum(map(len, tokens)) / max(row_steps[0], 1), stats.acceptance_rate, lookup_share)


def run_vllm(name: str, engine, prompts: list[list[int]], max_new_tokens: int, eos: set[int]) -> StreamRun:
    """One run of a started :class:`~tetris_hf.tools.vllm_system.VLLMEngine` on ``prompts``: every request added at
    once, ``LLMEngine.step()`` until all end. Tokens a row-step count the rows that got tokens in each step; acceptance
    is vLLM's own counter (accepted draft tokens / draft tokens)."""
    reply = engine.generate(prompts, max_new_tokens, sorted(eos))
    outputs = reply["outputs"]
    tokens = [_cut(list(output["tokens"]), eos) for output in outputs]
    spec = reply.get("spec") or {}
    acceptance = (spec["num_accepted_tokens"] / spec["num_draft_tokens"] if spec.get("num_draft_tokens") else None)
    return StreamRun(name, float(reply["seconds"]), [float(output["first_token"]) for output in outputs],
                     [float(output["finished"]) for output in outputs], tokens,
                     [(float(time_), int(rows)) for time_, rows in reply["occupancy"]],
                     sum(map(len, tokens)) / max(int(reply["row_steps"]), 1), acceptance)


def format_table(summaries: list[dict], reference: str) -> str:
    """One line per run: speed against ``reference``'s, latency, occupancy, and, for the stream, tokens a row-step,
    acceptance and (hybrid) the share of verified drafts lookup drafted."""
    base = next((row["tokens_per_second"] for row in summaries if row["name"] == reference), None)
    width = max([18] + [len(row["name"]) for row in summaries])
    header = (f"{'run':{width}s} {'tok/s':>7s} {'range':>11s} {'vs ' + reference:>21s} {'req/s':>6s} {'ttft p50':>8s} "
              f"{'p99':>6s} {'ms/tok p50':>10s} {'p99':>6s} {'rows':>5s} {'tok/row-step':>12s} {'accept':>6s} "
              f"{'lookup':>6s} {'= generate':>10s}")
    lines = [header, "-" * len(header)]

    def optional(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    for row in summaries:
        ratio = f"{row['tokens_per_second'] / base:.2f}x" if base else "-"
        lines.append(
            f"{row['name']:{width}s} {row['tokens_per_second']:7.1f} {row['range']:>11s} {ratio:>21s} "
            f"{row['requests_per_second']:6.2f} {row['ttft_p50']:7.1f}s {row['ttft_p99']:5.1f}s "
            f"{1000 * row['per_token_p50']:10.1f} {1000 * row['per_token_p99']:6.1f} "
            f"{optional(row['mean_live_rows'], '.1f'):>5s} "
            f"{optional(row.get('tokens_per_row_step'), '.2f'):>12s} {optional(row.get('acceptance'), '.2f'):>6s} "
            f"{optional(row.get('lookup_share'), '.2f'):>6s} {row['equal']:>10s}")
    started = [f"{row['name']} {row['startup_seconds']:.1f} s" for row in summaries if row.get("startup_seconds")]
    if started:
        lines.append("engine start-up and warm-up, not counted in tok/s: " + ", ".join(started))
    return "\n".join(lines)


def verdict(summaries: list[dict]) -> str:
    """The table in words, for a newcomer: which run was fastest and by how much against the faster plain system
    (transformers' ``generate_batch`` or static ``generate()`` chunks), whether every output matched, and why, from
    the runs' own numbers: tokens a row-step (1 for plain decoding), acceptance, the share of verified drafts that
    prompt lookup drafted, and rows kept busy."""
    plain = [row for row in summaries if row["name"] in ("hf-generate-batch", "generate-chunks")]
    if not plain:
        return ""
    best_plain = max(plain, key=lambda row: row["tokens_per_second"])
    fastest = max(summaries, key=lambda row: row["tokens_per_second"])
    ratio = fastest["tokens_per_second"] / best_plain["tokens_per_second"]
    equal = all(row["equal"] == "-" or len(set(row["equal"].split("/"))) == 1 for row in summaries)  # "24/24"
    lines = [f"Fastest: {fastest['name']}, {fastest['tokens_per_second']:.1f} tok/s = {ratio:.2f}x the faster plain "
             f"system ({best_plain['name']}, {best_plain['tokens_per_second']:.1f} tok/s); "
             + ("every output equal to plain greedy decoding's." if equal else "SOME OUTPUTS DIFFER (see '= generate').")]
    for row in summaries:
        if not row["name"].startswith("stream-") or row.get("tokens_per_row_step") is None:
            continue
        why = [f"{row['tokens_per_row_step']:.2f} tokens a row-step (plain: 1)"]
        if row.get("acceptance") and row["tokens_per_row_step"] > 1.005:  # (None or 0: nothing verified)
            why.append(f"{row['acceptance']:.0%} of verified drafts accepted")
        if row.get("lookup_share") is not None and row["tokens_per_row_step"] > 1.005:
            why.append(f"{row['lookup_share']:.0%} of them drafted by prompt lookup")
        if row.get("mean_live_rows") is not None:
            why.append(f"{row['mean_live_rows']:.1f} rows busy a step")
        relative = row["tokens_per_second"] / best_plain["tokens_per_second"]
        lines.append(f"  {row['name']}: {relative:.2f}x; " + ", ".join(why))
    lines.append("  (a stream keeps its rows full as requests end; speculation pays where each extra verified token "
                 "costs little and drafts are often accepted)")
    ours_plain = next((row for row in summaries if row["name"] == "stream-plain"), None)
    drafting = [row for row in summaries if row["name"].startswith("stream-") and row is not ours_plain]
    if ours_plain is not None and drafting:  # does drafting pay here, against the same stream without it?
        best = max(drafting, key=lambda row: row["tokens_per_second"])
        lines.append(f"Drafting against the same stream without it (stream-plain, {ours_plain['tokens_per_second']:.1f} "
                     f"tok/s): the fastest drafting run, {best['name']}, is "
                     f"{best['tokens_per_second'] / ours_plain['tokens_per_second']:.2f}x it.")
    engines = [row for row in summaries if is_vllm_system(row["name"])]
    ours = [row for row in summaries if not is_vllm_system(row["name"])]
    if engines and ours:  # vLLM's CPU engine is the bar issue 45 sets: our best against its best
        best_engine = max(engines, key=lambda row: row["tokens_per_second"])
        best_ours = max(ours, key=lambda row: row["tokens_per_second"])
        lines.append(f"Against vLLM: {best_ours['name']} {best_ours['tokens_per_second']:.1f} tok/s = "
                     f"{best_ours['tokens_per_second'] / best_engine['tokens_per_second']:.2f}x vLLM's best "
                     f"({best_engine['name']}, {best_engine['tokens_per_second']:.1f} tok/s)")
    return "\n".join(lines)


def plot(runs: list[StreamRun], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (live_axis, tokens_axis) = plt.subplots(1, 2, figsize=(12, 4.2))
    for index, run in enumerate(runs):
        color = f"C{index}"  # one colour a run in both panels (transformers' generate_batch has no occupancy line)
        if run.occupancy:
            times, rows = zip(*run.occupancy)
            live_axis.step(times, rows, where="post", label=run.name, color=color)
        order = sorted(zip(run.finished, (len(tokens) for tokens in run.tokens)))
        done, total = [0.0], [0]
        for end, count in order:
            done.append(end)
            total.append(total[-1] + count)
        tokens_axis.step(done, total, where="post", label=run.name, color=color)
    live_axis.set(xlabel="seconds", ylabel="rows decoding", title="batch occupancy")
    tokens_axis.set(xlabel="seconds", ylabel="tokens of finished requests", title="output over time")
    tokens_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="sharegpt", help="sharegpt | humaneval-edit | sharegpt-summarize | "
                        "mtbench | humaneval | a .jsonl file")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-batch-size", type=number_list(int, 1), default=(16,), help="comma list")
    parser.add_argument("--strategies", default="tetris,fixed,adaptive",
                        help="stream strategies (comma list; 'plain': the stream with speculation off), run after "
                             + ", ".join(SYSTEMS))
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"baselines to run (comma list): {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)}, vllm-ngram-k<N>; "
                        "vllm and vllm-ngram (at --num-assistant-tokens, or at k = N) run vLLM's CPU engine from "
                        "--vllm-python")
    parser.add_argument("--vllm-python", default=None,
                        help="the python of a venv with vLLM (scripts/setup_vllm.sh); default $TETRIS_HF_VLLM_PYTHON")
    parser.add_argument("--draft", default=None, help="a draft model (default: the shipped one), 'lookup' (prompt "
                        "lookup), 'suffix' (suffix drafts: the batch's rows and a cache of finished requests), or "
                        "'lookup,suffix' (every stream strategy once with each, named stream-<strategy>-<source>)")
    parser.add_argument("--suffix-seed", default=None, metavar="FILE",
                        help="with --draft suffix: seed every run's cache from FILE, earlier outputs as JSON lines, "
                             "one JSON array of token ids a line (tetris_hf.suffix_cache.SuffixCache.add_file)")
    parser.add_argument("--tree-width", type=int, default=1, metavar="W",
                        help="with --draft suffix (or lookup,suffix): suffix drafts as trees of W children per node "
                             "(tetris_tree_width; 1: chains)")
    parser.add_argument("--suffix-min-prob", type=float, default=None, metavar="P",
                        help="with --draft suffix (or lookup,suffix): tetris_suffix_min_prob, the calibrated survival "
                             "below which a suffix draft stops (default: the option's, "
                             f"{TetrisOptions.tetris_suffix_min_prob:g}; 0: every cell found)")
    parser.add_argument("--hybrid", action="store_true",
                        help="the draft model and prompt lookup together: each row drafts by lookup where it matches")
    parser.add_argument("--num-assistant-tokens", type=int, default=4, help="k")
    parser.add_argument("--extra-tokens", type=int, default=2, help="TETRIS e")
    parser.add_argument("--max-ngram", type=int, default=3, help="lookup's longest n-gram")
    parser.add_argument("--target", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompts-apart", action="store_true",
                        help="each stream strategy also with joining prompts read in forwards of their own")
    parser.add_argument("--compiled", action="store_true",
                        help="each stream strategy also with tetris_compile=True (stream-<strategy>-compiled); its "
                             "compiling first run is timed apart")
    parser.add_argument("--output", default="stream-out")
    add_kernel_argument(parser)


@dataclasses.dataclass
class StreamBenchConfig:
    """What to run: the baselines (:data:`SYSTEMS`), the stream's strategies, each at every ``max_batch_sizes``."""

    max_new_tokens: int = 256
    max_batch_sizes: tuple[int, ...] = (16,)
    systems: tuple[str, ...] = SYSTEMS
    strategies: tuple[str, ...] = ("tetris", "fixed", "adaptive")
    lookup: bool = False  # a model-free draft alone (prompt lookup, or suffix drafts with ``suffix``)
    hybrid: bool = False  # the draft model and prompt lookup, each row drafting by lookup where it matches
    num_assistant_tokens: int = 4
    extra_tokens: int = 2
    max_ngram: int = 3
    repeats: int = 1
    prompts_apart: bool = False  # each stream strategy also with ride_prompts=False
    vllm: VLLMSettings | None = None  # where vLLM runs from (systems vllm, vllm-ngram); None: they are not run
    suffix: bool = False  # with ``lookup``: suffix drafts (tetris_suffix_num_tokens) in prompt lookup's place
    sources: tuple[str, ...] = ()  # ("lookup", "suffix"): every stream strategy once per model-free source
    suffix_seed: str | None = None  # a seed file every run's suffix cache starts from (SuffixCache.add_file)
    compiled: bool = False  # each stream strategy also with tetris_compile=True
    tree_width: int = 1  # suffix drafts as trees of this many children per node (1: chains)
    suffix_min_prob: float | None = None  # tetris_suffix_min_prob for suffix drafts (None: the option's default)


def _gather(run: StreamRun, indices: list[int]) -> StreamRun:
    """One run's per-process parts (``accelerate launch``) as one: requests in their order, wall time the slowest
    process's."""
    from accelerate.utils import gather_object

    parts = gather_object([(dataclasses.asdict(run), list(indices))])
    by_index = {}
    for part, part_indices in parts:
        for position, index in enumerate(part_indices):
            by_index[index] = (part["first_token"][position], part["finished"][position], part["tokens"][position])
    ordered = [by_index[index] for index in sorted(by_index)]
    occupancy = sorted(point for part, _ in parts for point in part["occupancy"])
    return StreamRun(run.name, max(part["seconds"] for part, _ in parts), [item[0] for item in ordered],
                     [item[1] for item in ordered], [item[2] for item in ordered], occupancy)


def speculative_options(target, draft, config: StreamBenchConfig, suffix: bool | None = None):
    """A function giving each speculative run its drafting options: the draft model, prompt lookup, both, or suffix
    drafts (each run with a fresh cache of its own, seeded from ``config.suffix_seed`` when given, spanning the run's
    chunks or stream). ``suffix`` overrides ``config.suffix`` (runs comparing the model-free sources)."""
    lookup = {"prompt_lookup_num_tokens": config.num_assistant_tokens, "max_matching_ngram_size": config.max_ngram}
    model = {"assistant_model": draft, "num_assistant_tokens": config.num_assistant_tokens}
    speculative = lookup if config.lookup else {**model, **lookup} if config.hybrid else model
    if not (config.suffix if suffix is None else suffix):
        return lambda: speculative
    from ..suffix_cache import SuffixCache

    vocab_size = target.get_output_embeddings().weight.shape[0]
    seed = config.suffix_seed
    min_prob = {} if config.suffix_min_prob is None else {"tetris_suffix_min_prob": config.suffix_min_prob}
    return lambda: {"tetris_suffix_num_tokens": config.num_assistant_tokens, "tetris_tree_width": config.tree_width,
                    "tetris_suffix_cache": SuffixCache() if seed is None else SuffixCache.from_file(seed, vocab_size),
                    **min_prob}


def stream_prompts(target, tokenizer, prompts: str, num_prompts: int,
                   max_prompt_tokens: int) -> tuple[list[list[int]], str, set[int], int]:
    """The prompt set named ``prompts`` as a stream takes it: ``(token ids of each prompt, the set's note, the
    target's end tokens, the pad token)`` (pad: the tokenizer's, else the smallest end token).

    Raises:
        UsageError: the target has no ``eos_token_id`` (a stream of natural lengths needs one).
    """
    texts, note = prompt_texts(load_prompt_set(prompts), num_prompts, tokenizer, max_prompt_tokens)
    token_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    eos_setting = target.generation_config.eos_token_id
    eos = {int(token) for token in ([eos_setting] if isinstance(eos_setting, int) else eos_setting or [])}
    if not eos:
        raise UsageError("the target has no eos_token_id: a stream of natural lengths needs one")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return token_ids, note, eos, pad


def run_stream_bench(target, draft, prompts: list[list[int]], eos: set[int], pad: int, config: StreamBenchConfig,
                     state=None, log=print) -> dict:
    """Every system and stream strategy on ``prompts`` (token ids), ``config.repeats`` times in turn, at each batch
    size. Returns ``{"runs": {batch_size: [summary, ...]}, "medians": {batch_size: [StreamRun, ...]}}``; under
    ``accelerate launch`` (``state``) each process serves its share of the requests and the runs are gathered."""
    indices = list(range(len(prompts)))
    if state is not None:
        with state.split_between_processes(indices) as mine:
            indices = list(mine)
    mine = [prompts[index] for index in indices]
    drafts = speculative_options(target, draft, config)
    report = {"runs": {}, "medians": {}, "startup": {}}
    systems = list(config.systems)
    wanted = [name for name in systems if is_vllm_system(name)]
    if wanted and (config.vllm is None or state is not None):
        why = ("no vLLM python (see --vllm-python)" if config.vllm is None
               else "vLLM runs in one process, not under accelerate launch")
        log(f"  {', '.join(wanted)} not run: {why}")
        systems = [name for name in systems if not is_vllm_system(name)]
    threads = torch.get_num_threads()
    for batch_size in config.max_batch_sizes:
        plans = []
        engines = {}  # vLLM system -> its engine, started at its first run (start-up timed apart)

        def vllm_run(name: str, b: int) -> StreamRun:
            from .vllm_system import VLLMEngine, speculative_config

            if name not in engines:
                log_path = Path(config.vllm.log_dir) / f"{name}-b{b}.log" if config.vllm.log_dir else None
                engine = VLLMEngine(config.vllm.python, config.vllm.model, max_num_seqs=b,
                                    max_model_len=max(map(len, mine)) + config.max_new_tokens, threads=threads,
                                    speculative=speculative_config(name, config.num_assistant_tokens,
                                                                   config.max_ngram),
                                    log_path=log_path, worker=config.vllm.worker)
                engines[name] = engine
                engine.start()
                # A fresh engine's first run pays one-off costs (a first run here, 8 requests of up to 32 new
                # tokens, went at 9.5 tok/s): a warm-up on the same prompts, two new tokens each, pays them apart.
                warm_up = engine.generate(mine, 2, sorted(eos))["seconds"]
                report["startup"].setdefault(b, {})[name] = engine.startup_seconds + warm_up
                log(f"  B={b} {name}: engine started in {engine.startup_seconds:.1f} s, warm-up {warm_up:.1f} s "
                    f"(vLLM {engine.ready.get('vllm_version', '?')}, {threads} threads bound to "
                    f"{engine.ready.get('omp_bind')}, {engine.ready.get('allocator', '?')}; not counted in tok/s)")
            return run_vllm(name, engines[name], mine, config.max_new_tokens, eos)

        for name in systems:
            if is_vllm_system(name):
                plans.append((name, lambda b=batch_size, n=name: vllm_run(n, b)))
            elif name == "hf-generate-batch":
                plans.append((name, lambda b=batch_size: run_hf_generate_batch(target, mine, config.max_new_tokens,
                                                                               b, eos, pad)))
            elif name == "generate-chunks":
                plans.append((name, lambda b=batch_size: run_chunks("generate-chunks", target, mine,
                                                                    config.max_new_tokens, b, eos, pad)))
            else:
                plans.append((name, lambda b=batch_size: run_chunks(
                    "tetris-chunks", target, mine, config.max_new_tokens, b, eos, pad, custom_generate="tetris",
                    tetris_extra_tokens=config.extra_tokens, **drafts())))
        for strategy in config.strategies:
            # "plain": the stream with speculation off (its drafter never drafts: tetris_budget=0)
            settings = {"tetris_budget": 0} if strategy == "plain" else {"tetris_strategy": strategy}
            sources = config.sources if config.sources and strategy != "plain" else ("",)
            variants = itertools.product((True, False) if config.prompts_apart else (True,), sources,
                                         (False, True) if config.compiled else (None,))
            for ride, source, compiled in variants:
                trees = f"-w{config.tree_width}" if source == "suffix" and config.tree_width > 1 else ""
                name = (f"stream-{strategy}" + ("" if ride else "-apart") + (f"-{source}{trees}" if source else "")
                        + ("-compiled" if compiled else ""))
                options = speculative_options(target, draft, config, source == "suffix") if source else drafts
                plans.append((name, lambda b=batch_size, s=settings, n=name, r=ride, o=options, c=compiled: run_stream(
                    n, target, mine, config.max_new_tokens, b, eos, pad, tetris_extra_tokens=config.extra_tokens,
                    ride_prompts=r, tetris_compile=c, **s, **o())))
        runs: dict[str, list[StreamRun]] = {name: [] for name, _ in plans}
        try:
            for name, run in plans:
                if name.endswith("-compiled"):
                    report["startup"].setdefault(batch_size, {})[name] = compile_run(name, run, batch_size, log)
            for repeat in range(config.repeats):
                for name, run in plans:
                    with torch.no_grad():
                        result = run()
                    runs[name].append(result if state is None else _gather(result, indices))
                    log(f"  B={batch_size} repeat {repeat + 1}/{config.repeats} {name}: "
                        f"{runs[name][-1].summary()['tokens_per_second']:.1f} tok/s")
        finally:
            for engine in engines.values():
                engine.close()
        # outputs are checked against static generate()'s, else transformers' generate_batch's (both plain greedy)
        baseline = next((name for name in ("generate-chunks", "hf-generate-batch") if name in runs), None)
        reference = runs[baseline][0].tokens if baseline else None
        summaries, medians = [], []
        for name, results in runs.items():
            speeds = [result.summary()["tokens_per_second"] for result in results]
            median = sorted(results, key=lambda result: result.summary()["tokens_per_second"])[len(results) // 2]
            summary = median.summary()
            summary["range"] = f"{min(speeds):.1f}-{max(speeds):.1f}"
            summary["repeats"] = speeds
            equal = sum(a == b for a, b in zip(median.tokens, reference)) if reference else None
            summary["equal"] = f"{equal}/{len(median.tokens)}" if equal is not None else "-"
            startup = report["startup"].get(batch_size, {}).get(name)
            if startup is not None:
                summary["startup_seconds"] = startup  # vLLM's engine start-up, a compiled stream's compile run
            summaries.append(summary)
            medians.append(median)
        report["runs"][batch_size] = summaries
        report["medians"][batch_size] = medians
    return report


def compile_run(name: str, run, batch_size: int, log=print) -> float:
    """A compiled system's first run, untimed by the table: it compiles every shape the timed runs meet. Logs its
    seconds and the graphs dynamo compiled in it; returns the seconds."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    with torch.no_grad():
        run()
    seconds = time.perf_counter() - started
    log(f"  B={batch_size} {name}: compile run {seconds:.1f} s, "
        f"{counters['stats']['unique_graphs'] - graphs} graphs compiled (not counted in tok/s)")
    return seconds


def reference_name(summaries: list[dict]) -> str:
    """The faster of transformers' ``generate_batch`` and static ``generate()`` chunks (what a stream must beat)."""
    baselines = [row for row in summaries if row["name"] in ("hf-generate-batch", "generate-chunks")]
    return max(baselines, key=lambda row: row["tokens_per_second"])["name"] if baselines else summaries[0]["name"]


def check_suffix_seed(path: str | None, suffix: bool, vocab_size: int | None = None) -> None:
    """Refuse ``--suffix-seed`` without ``--draft suffix`` or a file; given the target's ``vocab_size``, a bad file
    too, naming its line (before any run, not after the baselines ran)."""
    if path is None:
        return
    if not suffix:
        raise UsageError("--suffix-seed seeds suffix drafts' cache: pass --draft suffix too")
    if not Path(path).is_file():
        raise UsageError(f"--suffix-seed {path!r}: no such file")
    if vocab_size is not None:
        from ..suffix_cache import read_token_lists

        try:
            read_token_lists(path, vocab_size)
        except ValueError as error:
            raise UsageError(f"--suffix-seed: {error}") from None


def suffix_target(info, target, seed: str | None):
    """``--draft suffix``: the loaded target's description with suffix drafts as its draft, once the seed file (if
    any) is known to be good for this target's vocabulary."""
    check_suffix_seed(seed, True, target.get_output_embeddings().weight.shape[0])
    return dataclasses.replace(info, draft_kind="suffix", draft="suffix drafts (the batch's rows and a cache of "
                               "finished requests" + (f", seeded from {seed})" if seed else ")"))


def main(args) -> int:
    from .bench import distributed_state

    device = resolve_device(args.device)
    state = distributed_state(device)
    if state is not None and device.type == "cuda":
        device = state.device  # one GPU per process
    sources = tuple(args.draft.split(",")) if args.draft and set(args.draft.split(",")) <= {"lookup", "suffix"} else ()
    lookup, suffix = bool(sources), sources[:1] == ("suffix",)
    if len(sources) > 1 and len(set(sources)) != len(sources):
        raise UsageError(f"--draft {args.draft}: name each model-free source once")
    check_suffix_seed(args.suffix_seed, "suffix" in sources)
    if args.tree_width < 1 or (args.tree_width > 1 and "suffix" not in sources):
        raise UsageError(f"--tree-width {args.tree_width}: suffix drafts grow trees (1: chains); pass --draft suffix "
                         "or lookup,suffix with a width of 1 or more")
    if args.suffix_min_prob is not None and ("suffix" not in sources or not 0 <= args.suffix_min_prob < 1):
        raise UsageError(f"--suffix-min-prob {args.suffix_min_prob}: a number in [0, 1) for suffix drafts; pass "
                         "--draft suffix or lookup,suffix")
    if args.tree_width > 1 and args.compiled:
        raise UsageError("--tree-width with --compiled: compiled steps draft chains only; choose one")
    if lookup:
        from .bench import load_lookup_target

        target, tokenizer, info = load_lookup_target(args.target, device, None, args.max_ngram)
        if "suffix" in sources:
            info = suffix_target(info, target, args.suffix_seed)
        draft = None
    else:
        target, draft, tokenizer, info = load_pair(args.target, args.draft, device)
    kernels = apply_kernels(args, target, draft)
    prompts, note, eos, pad = stream_prompts(target, tokenizer, args.prompts, args.num_prompts, args.max_prompt_tokens)
    systems = tuple(name for name in args.systems.split(",") if name)
    unknown = {name for name in systems if name not in SYSTEMS and not is_vllm_system(name)}
    if unknown:
        raise UsageError(f"unknown --systems {sorted(unknown)}: choose from {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)} "
                         "or vllm-ngram-k<N>")
    vllm = None
    if any(map(is_vllm_system, systems)):
        from .vllm_system import VLLMUnavailable, find_vllm, model_folder

        try:
            python, version = find_vllm(args.vllm_python)
            vllm = VLLMSettings(python, model_folder(args.target), version, log_dir=args.output)
            Path(args.output).mkdir(parents=True, exist_ok=True)
        except VLLMUnavailable as error:
            print(f"{error}; going on with the other systems", flush=True)
    if lookup and args.hybrid:
        raise UsageError("--hybrid drafts with the model and lookup together: give a draft model (or none), not "
                         f"--draft {args.draft}")
    config = StreamBenchConfig(args.max_new_tokens, tuple(args.max_batch_size), systems,
                               tuple(name for name in args.strategies.split(",") if name), lookup, args.hybrid,
                               args.num_assistant_tokens, args.extra_tokens, args.max_ngram, args.repeats,
                               args.prompts_apart, vllm=vllm, suffix=suffix, suffix_seed=args.suffix_seed,
                               sources=sources if len(sources) > 1 else (), compiled=args.compiled,
                               tree_width=args.tree_width, suffix_min_prob=args.suffix_min_prob)
    main_process = state is None or state.is_main_process
    log = (lambda line: print(line, flush=True)) if main_process else (lambda line: None)
    allocator = loaded_allocator()
    log(f"{len(prompts)} requests ({note}); prompt tokens {min(map(len, prompts))}-{max(map(len, prompts))}, "
        f"up to {args.max_new_tokens} new; {device}"
        f"{f', {state.num_processes} processes' if state is not None else ''}\n{info}\n{kernels}\n"
        f"{allocator_note(allocator)}")
    report = run_stream_bench(target, draft, prompts, eos, pad, config, state, log)
    if not main_process:
        return 0
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    saved = {"prompts": args.prompts, "note": note, "num_requests": len(prompts), "command": vars(args) | {
        "_main": None}, "allocator": allocator,
             "runs": {str(size): rows for size, rows in report["runs"].items()},
             "timelines": {str(size): [{"name": run.name, "occupancy": run.occupancy, "finished": run.finished,
                                        "tokens": [len(tokens) for tokens in run.tokens]} for run in runs]
                           for size, runs in report["medians"].items()}}
    for batch_size, summaries in report["runs"].items():
        table = format_table(summaries, reference_name(summaries))
        words = verdict(summaries)
        log(f"\nmax_batch_size {batch_size}, {len(prompts)} requests, median of {args.repeats}:\n{table}\n\n{words}\n")
        (output / f"table-b{batch_size}.txt").write_text(table + "\n\n" + words + "\n")
        plot(report["medians"][batch_size], output / f"stream-b{batch_size}.png",
             f"{args.prompts}: {len(prompts)} requests, max_batch_size {batch_size}")
    (output / "results.json").write_text(json.dumps(saved, indent=1, default=str))
    log(f"wrote {output / 'results.json'}, the tables and the plots")
    return 0
