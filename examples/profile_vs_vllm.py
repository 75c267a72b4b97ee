"""Where a step goes: vLLM's CPU engine against our stream and static paths, on the same prompts, under torch.profiler.

    export TETRIS_HF_VLLM_PYTHON=/work/vllm-venv/bin/python     # scripts/setup_vllm.sh makes it
    OMP_NUM_THREADS=2 python examples/profile_vs_vllm.py --prompts humaneval-edit --num-prompts 32 \\
        --max-new-tokens 128 --max-batch-size 16 --output docs/bench-vllm/profile-humaneval-edit

Every system serves the same requests (token ids, greedy, fp32, the target's end tokens, at most
``--max-batch-size`` rows, as many threads as this process has) three times:

0. a warm-up with two new tokens a prompt (first-call costs, a first decode or verify step among them; for a
   compiled path a full run follows, which compiles and is reported apart as ``compile run``);
1. a timed run (its tokens/s);
2. the same run under ``torch.profiler`` (CPU activities; vLLM's inside its own process, see
   ``tetris_hf/tools/vllm_worker.py``): every op's self time, sorted into kinds by :func:`kind_of`;
3. the same prompts with one new token each: what reading the prompts (prefill) costs on its own.

Systems (``--systems``):

- ``vllm``, ``vllm-ngram``: vLLM's CPU engine without speculation and with n-gram lookup (k = ``--k``), prefix caching
  off, engine start-up reported apart;
- ``stream-plain``, ``stream-lookup``: our request stream, eager, without speculation and with prompt lookup (TETRIS,
  k, e = 2); ``stream-plain-compiled``, ``stream-lookup-compiled``: the same with ``tetris_compile=True``;
- ``static-lookup``, ``static-lookup-compiled``: static ``generate(custom_generate="tetris")`` with prompt lookup on
  chunks of ``--max-batch-size``, eager and with ``tetris_compile=True``;
- ``generate``: transformers' static ``generate()`` on the same chunks, eager.

The table gives, per kind, ms per step and its share of the profiled run; "Python & host" is the run's wall time not
inside any op (the interpreter, the engines' bookkeeping, the profiler's own cost). A step is one forward of the
target as each engine counts it (a decode or verify step; vLLM: an engine step that produced tokens), so steps that
verify several tokens a row cost more and are fewer. Writes ``profile.json`` (every op of every system) and
``table.txt`` into ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.tools import stream_bench
from tetris_hf.tools.cli import add_kernel_argument, apply_kernels
from tetris_hf.tools.models import load_target

# New tokens a prompt in the warm-up run: 2, so that a first decode (or verify) step runs in it too. (The first
# recorded runs warmed up with 1: vLLM n-gram's timed run then went at 25.4 tok/s and its profiled run right after
# at 76.2, one thread, 16 code edits: one-off costs of its first speculative steps.)
WARM_UP_TOKENS = 2
SYSTEMS = ("vllm", "vllm-ngram", "stream-plain", "stream-lookup", "stream-plain-compiled", "stream-lookup-compiled",
           "static-lookup", "static-lookup-compiled",
           "generate")

# Kinds of op, in the table's order. An op's kind is the first whose test matches its name (lower case).
KINDS = (
    ("matmul / linear", ("onednn_mm", "mkl", "gemm", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul",
                         "aten::linear", "aten::baddbmm", "aten::_weight_int8", "aten::_addmm",
                         "tetris_hf::onednn_linear", "tetris_hf::sibling_linears")),
    ("attention + KV cache", ("attention", "attn", "scaled_dot_product", "sdpa", "flash", "kv_cache",
                              "reshape_and_cache", "slot_mapping", "scheduler_metadata")),
    ("fused kernels (inductor)", ("## call compiledfxgraph", "cpp_fused", "torch-compiled region",
                                  "compiledfunction")),
    ("sampling / logits", ("argmax", "topk", "aten::sort", "multinomial", "sampler", "aten::softmax",
                           "aten::_softmax", "log_softmax")),
    ("compile runtime (guards, wrappers)", ("pregraph", "aotdispatcher", "torchdynamo", "dynamo", "guard")),
    ("views, allocation, sync", ("aten::as_strided", "aten::view", "aten::slice", "aten::narrow", "aten::split",
                                 "aten::chunk", "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::expand",
                                 "aten::transpose", "aten::t", "aten::permute", "aten::select", "aten::detach",
                                 "aten::alias", "aten::empty", "aten::new_empty", "aten::resolve_", "aten::lift_fresh",
                                 "aten::item", "aten::_local_scalar_dense", "aten::flatten", "aten::unflatten",
                                 "aten::_unsafe_view", "aten::unbind", "aten::is_nonzero", "aten::contiguous",
                                 "aten::result_type", "aten::broadcast_tensors", "aten::_reshape_alias")),
)
OTHER_OPS = "norms, elementwise, copies (eager ops)"
HOST = "Python & host (outside ops)"
ROWS = tuple(name for name, _ in KINDS) + (OTHER_OPS, HOST)


def kind_of(name: str) -> str:
    """The kind of a profiler event (its name), one of :data:`ROWS` except :data:`HOST`. Exact names such as
    ``aten::t`` or ``aten::view`` match whole; the others by substring."""
    lower = name.lower()
    for kind, tests in KINDS:
        for test in tests:
            if lower == test or (test not in ("aten::t", "aten::view", "aten::mm", "aten::item") and test in lower):
                return kind
    return OTHER_OPS


def breakdown(ops: list[list], wall_seconds: float, steps: int) -> dict:
    """``ops`` (``[name, self_us, calls]`` from ``profiler.key_averages()``) of a run of ``wall_seconds`` and ``steps``
    steps, by kind: ``{kind: {"ms_per_step", "share"}}`` plus ``"top"``: the heaviest ops of each kind."""
    totals = {kind: 0.0 for kind in ROWS}
    top: dict[str, list] = {kind: [] for kind in ROWS}
    for name, self_us, calls in ops:
        kind = kind_of(name)
        totals[kind] += self_us / 1e6
        top[kind].append([name, self_us / 1e6, calls])
    inside = sum(totals.values())
    totals[HOST] = max(0.0, wall_seconds - inside)
    steps = max(steps, 1)
    return {"wall_seconds": wall_seconds, "steps": steps,
            "kinds": {kind: {"ms_per_step": 1000 * seconds / steps, "share": seconds / wall_seconds if wall_seconds
                             else 0.0} for kind, seconds in totals.items()},
            "top": {kind: sorted(rows, key=lambda row: -row[1])[:6] for kind, rows in top.items() if rows}}


def profiled(function):
    """Run ``function()`` under torch.profiler (CPU): ``(its result, ops as [name, self_us, calls], wall seconds)``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        result = function()
        seconds = time.perf_counter() - start
    return result, [[event.key, event.self_cpu_time_total, event.count] for event in profiler.key_averages()], seconds


def our_runner(system: str, target, prompts, max_new_tokens: int, batch_size: int, eos: set[int], pad: int, k: int):
    """A function ``(max_new_tokens) -> StreamRun`` for one of our systems."""
    lookup = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3, "tetris_extra_tokens": 2}
    compiled = {"tetris_compile": system.endswith("-compiled")}
    if system.startswith("stream-plain"):
        return lambda new: stream_bench.run_stream(system, target, prompts, new, batch_size, eos, pad, tetris_budget=0,
                                                   **lookup, **compiled)  # (a drafter that never drafts: budget 0)
    if system.startswith("stream-lookup"):
        return lambda new: stream_bench.run_stream(system, target, prompts, new, batch_size, eos, pad,
                                                   tetris_strategy="tetris", **lookup, **compiled)
    if system in ("static-lookup", "static-lookup-compiled"):
        return lambda new: stream_bench.run_chunks(system, target, prompts, new, batch_size, eos, pad,
                                                   custom_generate="tetris",
                                                   tetris_compile=system.endswith("compiled"), **lookup)
    if system == "generate":
        return lambda new: stream_bench.run_chunks(system, target, prompts, new, batch_size, eos, pad)
    raise ValueError(f"unknown system {system!r}")


def measure_ours(system: str, runner, max_new_tokens: int, log) -> dict:
    result = {}
    with torch.no_grad():
        runner(WARM_UP_TOKENS)  # warm-up: first-call costs (the cost profile, allocations) out of the timed runs
        if system.endswith("compiled"):
            start = time.perf_counter()
            runner(max_new_tokens)
            result["compile_run_seconds"] = time.perf_counter() - start
            log(f"  {system}: compile run {result['compile_run_seconds']:.1f} s")
        run = runner(max_new_tokens)
        run_profiled, ops, seconds = profiled(lambda: runner(max_new_tokens))
        start = time.perf_counter()
        runner(1)
        result["prefill_seconds"] = time.perf_counter() - start
    result.update(tokens=[len(tokens) for tokens in run.tokens], outputs=run.tokens, seconds=run.seconds,
                  tokens_per_second=sum(map(len, run.tokens)) / run.seconds,
                  profile=breakdown(ops, seconds, len(run_profiled.occupancy)), ops=ops,
                  profiled_tokens=sum(map(len, run_profiled.tokens)))
    return result


def measure_vllm(system: str, settings, prompts, max_new_tokens: int, batch_size: int, eos: set[int], k: int,
                 output: Path, log) -> dict:
    from tetris_hf.tools.vllm_system import VLLMEngine, speculative_config

    engine = VLLMEngine(settings.python, settings.model, max_num_seqs=batch_size,
                        max_model_len=max(map(len, prompts)) + max_new_tokens, threads=torch.get_num_threads(),
                        speculative=speculative_config(system, k, 3), log_path=output / f"{system}.log")
    with engine:
        engine.start()
        log(f"  {system}: engine start-up {engine.startup_seconds:.1f} s (not counted)")
        engine.generate(prompts, WARM_UP_TOKENS, sorted(eos))  # warm-up, as ours
        run = stream_bench.run_vllm(system, engine, prompts, max_new_tokens, eos)
        reply = engine.generate(prompts, max_new_tokens, sorted(eos), profile=True)
        prefill = engine.generate(prompts, 1, sorted(eos))
    return {"startup_seconds": engine.startup_seconds, "tokens": [len(tokens) for tokens in run.tokens],
            "outputs": run.tokens, "seconds": run.seconds, "tokens_per_second": sum(map(len, run.tokens)) / run.seconds,
            "prefill_seconds": prefill["seconds"], "acceptance": run.acceptance,
            "profile": breakdown(reply["profile"], reply["seconds"], reply["steps"]), "ops": reply["profile"],
            "profiled_tokens": sum(len(stream_bench._cut(o["tokens"], eos)) for o in reply["outputs"])}


def format_table(results: dict, reference: str | None) -> str:
    """Kinds down, systems across: ms per step (share of the run) under the profiler; then steps, tokens a step,
    tokens/s (unprofiled), the prefill run's seconds and whether the outputs equal ``reference``'s."""
    names = list(results)
    width = max(16, *(len(name) + 2 for name in names))
    lines = [f"{'ms per step (share)':38s}" + "".join(f"{name:>{width}s}" for name in names)]
    for kind in ROWS:
        cells = []
        for name in names:
            cell = results[name]["profile"]["kinds"][kind]
            cells.append(f"{cell['ms_per_step']:.1f} ({100 * cell['share']:.0f}%)")
        lines.append(f"{kind:38s}" + "".join(f"{cell:>{width}s}" for cell in cells))

    def row(label: str, values) -> None:
        lines.append(f"{label:38s}" + "".join(f"{value:>{width}s}" for value in values))

    row("step, profiled (ms)", [f"{1000 * r['profile']['wall_seconds'] / r['profile']['steps']:.1f}"
                                for r in results.values()])
    row("steps", [str(r["profile"]["steps"]) for r in results.values()])
    row("tokens a step", [f"{r['profiled_tokens'] / r['profile']['steps']:.2f}" for r in results.values()])
    row("tok/s, unprofiled", [f"{r['tokens_per_second']:.1f}" for r in results.values()])
    row("profiler's slow-down", [f"{r['profile']['wall_seconds'] / r['seconds']:.2f}x" for r in results.values()])
    row("prefill: 1 new token a prompt (s)", [f"{r['prefill_seconds']:.1f}" for r in results.values()])
    row("load average (1 min) after", [f"{r['load_average_after']:.1f}" for r in results.values()])
    row("start-up / compile run (s)", [f"{r.get('startup_seconds', r.get('compile_run_seconds', 0)):.0f}"
                                       if ("startup_seconds" in r or "compile_run_seconds" in r) else "-"
                                       for r in results.values()])
    if reference is not None:
        expected = results[reference]["outputs"]
        row(f"outputs equal {reference}'s", [f"{sum(a == b for a, b in zip(r['outputs'], expected))}/{len(expected)}"
                                             for r in results.values()])
    return "\n".join(lines)


def report(results: dict, command: dict) -> str:
    """The table (:func:`format_table`) under a line saying what ran, and each system's heaviest ops by kind."""
    reference = next((name for name in ("generate", "stream-plain", "vllm") if name in results), None)
    table = format_table(results, reference)
    heavy = []
    for name, result in results.items():
        steps = result["profile"]["steps"]
        heavy.append(f"{name}: " + "; ".join(f"{kind}: " + ", ".join(f"{op} {1000 * seconds / steps:.1f}"
                                                                     for op, seconds, _ in ops[:3])
                                             for kind, ops in result["profile"]["top"].items()))
    return (f"{command['prompts']}: {command['num_prompts']} prompts, {command['max_new_tokens']} new tokens, "
            f"{command['max_batch_size']} rows, {results and next(iter(results.values())).get('threads', '?')} "
            f"threads\n{table}\n\nheaviest ops (ms a step):\n" + "\n".join(heavy))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="humaneval-edit")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--k", type=int, default=4, help="draft tokens a row (lookup, and vLLM's n-gram)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    parser.add_argument("--vllm-python", default=None, help="default $TETRIS_HF_VLLM_PYTHON")
    parser.add_argument("--output", default="profile-vs-vllm")
    add_kernel_argument(parser)
    parser.add_argument("--from-json", default=None,
                        help="print the table of a profile.json written earlier (a run cut short included)")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(report(saved["results"], saved["command"]))
        return 0
    systems = [name for name in args.systems.split(",") if name]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown --systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    log = lambda line: print(line, flush=True)  # noqa: E731

    target, tokenizer = load_target(None)
    log(apply_kernels(args, target))
    prompts, note, eos, pad = stream_bench.stream_prompts(target, tokenizer, args.prompts, args.num_prompts,
                                                          args.max_prompt_tokens)
    log(f"{len(prompts)} prompts ({note}), {min(map(len, prompts))}-{max(map(len, prompts))} tokens, up to "
        f"{args.max_new_tokens} new, at most {args.max_batch_size} rows, {torch.get_num_threads()} threads")

    settings = None
    if any(name.startswith("vllm") for name in systems):
        from tetris_hf.tools.vllm_system import VLLMSettings, VLLMUnavailable, find_vllm, model_folder

        try:
            python, version = find_vllm(args.vllm_python)
            settings = VLLMSettings(python, model_folder(None), version)
            log(f"vLLM {version} from {python}")
        except VLLMUnavailable as error:
            log(f"{error}; going on with the other systems")
            systems = [name for name in systems if not name.startswith("vllm")]

    results = {}
    for name in systems:
        log(f"{name} ...")
        if name.startswith("vllm"):
            results[name] = measure_vllm(name, settings, prompts, args.max_new_tokens, args.max_batch_size, eos,
                                         args.k, output, log)
        else:
            runner = our_runner(name, target, prompts, args.max_new_tokens, args.max_batch_size, eos, pad, args.k)
            results[name] = measure_ours(name, runner, args.max_new_tokens, log)
        results[name]["threads"] = torch.get_num_threads()
        results[name]["load_average_after"] = os.getloadavg()[0]  # the machine's load: other sessions share it
        log(f"  {name}: {results[name]['tokens_per_second']:.1f} tok/s, "
            f"{1000 * results[name]['profile']['wall_seconds'] / results[name]['profile']['steps']:.1f} ms a step "
            "profiled")
        (output / "profile.json").write_text(json.dumps({"command": vars(args), "note": note, "results": results}))
    text = report(results, vars(args))
    log("\n" + text)
    (output / "table.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
