"""Suffix drafts against prompt lookup at the same ``k``, in the loop: a request stream serves the same prompts with
each drafter (greedy, so both emit the same tokens) and this prints tokens per row-step (tokens emitted per row per
target forward), the share of row-steps that accepted anything, and the drafter's host time per step as a share of
the step, for each prompt set; and, per drafter, how far drafts get: the share of row-steps that drafted anything and
``P(cell j accepted | the cells before it were)`` for ``j = 1..k``.

Requests are served in order through one stream of ``--max-batch-size`` rows: later requests draft from the cache of
the ones that finished before them (and from the rows decoding beside them).

    python examples/suffix_vs_lookup.py --prompts humaneval-edit,extraction --num-prompts 16 --max-new-tokens 64

``--tree-width 1,2,3`` serves the suffix runs once per width (``w > 1``: suffix trees, ``tetris_tree_width=w``) and
prints each against lookup and against the suffix chains. ``--min-prob 0,0.1,0.2`` serves them once per
``tetris_suffix_min_prob`` (the calibrated survival below which a suffix draft stops); "verified/row-step" is the
cells the target verified per row-step, what drafting costs.

``--time-proposal`` instead times one proposal of each drafter on the host (CPU time on this process's threads, the
lower quartile of 30 calls) for ``--rows`` rows of ``--row-tokens`` tokens and a full suffix cache (256 requests of
512 tokens), beside one plain decode step of the target at that batch and length.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tetris_hf.candidate_generators.prompt_lookup import BatchedPromptLookupCandidateGenerator
from tetris_hf.candidate_generators.suffix import SuffixCandidateGenerator
from tetris_hf.options import TetrisOptions
from tetris_hf.stream import RequestStream
from tetris_hf.suffix_cache import SuffixCache
from tetris_hf.tools.cli import prompt_texts
from tetris_hf.tools.data import load_prompts
from tetris_hf.tools.models import load_target


def serve(target, prompts: list[list[int]], drafter: str, k: int, strategy: str, max_batch_size: int,
          max_new_tokens: int, eos: int | None, tree_width: int = 1, min_prob: float = 0.0) -> dict:
    """Every prompt through one stream drafting with ``drafter`` (``"lookup"`` or ``"suffix"``, trees of
    ``tree_width`` when above 1); what it measured (for trees no per-cell acceptance: a tree has no cell ``j``)."""
    counts = {"row_steps": 0, "emitted": 0, "accepted_rows": 0, "draft_s": 0.0, "step_s": 0.0, "steps": 0,
              "drafting_rows": 0, "verified": 0, "reached": [0] * k, "accepted": [0] * k}

    def count(record, loop):
        counts["row_steps"] += record.rows.numel()
        emitted = record.emitted
        counts["emitted"] += int(emitted.sum())
        counts["accepted_rows"] += int((record.num_accepted > 0).sum())
        drafted = torch.minimum(record.drafted_lengths, record.verify_lengths)  # (B,) cells drafted and verified
        counts["drafting_rows"] += int((drafted > 0).sum())
        counts["verified"] += int(record.verify_lengths.sum())
        for cell in range(k if record.tree is None else 0):
            reached = (drafted > cell) & (record.num_accepted >= cell)  # the cells before it were accepted
            counts["reached"][cell] += int(reached.sum())
            counts["accepted"][cell] += int((reached & (record.num_accepted > cell)).sum())
        counts["draft_s"] += record.seconds.draft
        counts["step_s"] += sum(record.seconds)
        counts["steps"] += 1

    options = {"prompt_lookup_num_tokens": k} if drafter == "lookup" else {"tetris_suffix_num_tokens": k,
                                                                           "tetris_suffix_min_prob": min_prob}
    stream = RequestStream(target, max_batch_size=max_batch_size, tetris_strategy=strategy, eos_token_id=eos,
                           tetris_step_callback=count, tetris_tree_width=tree_width, **options)
    ids = [stream.add(prompt, max_new_tokens=max_new_tokens) for prompt in prompts]
    started = time.perf_counter()
    outputs = {output.request_id: output.generated_tokens for output in stream.run()}
    seconds = time.perf_counter() - started
    return {**counts, "seconds": seconds, "outputs": [outputs[i] for i in ids]}


def cpu_ms(call, repeats: int = 30) -> float:
    """The lower quartile of ``call``'s CPU time in ms (a shared machine's other work stays out of it)."""
    call()
    times = []
    for _ in range(repeats):
        started = time.process_time()
        call()
        times.append(time.process_time() - started)
    return sorted(times)[repeats // 4] * 1e3


def time_proposal(target, rows: int, row_tokens: int, k: int) -> None:
    """Host time of one proposal of each drafter against a plain decode step (random tokens with repeats)."""
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    cache = SuffixCache()
    for _ in range(cache.max_requests):  # a full cache; each request repeats a passage, as outputs do
        request = torch.randint(vocab, (1, cache.width), generator=generator)
        request[:, 200:300] = request[:, :100]
        cache.add(request, torch.tensor([cache.width]))
    sequences = torch.randint(vocab, (rows, row_tokens + k), generator=generator)
    sequences[:, row_tokens - 100: row_tokens] = sequences[:, 100:200]
    lengths = torch.full((rows,), row_tokens)
    mask = torch.ones(rows, row_tokens, dtype=torch.long)
    drafters = {"suffix": SuffixCandidateGenerator(max_tokens=k, cache=cache),
                "lookup": BatchedPromptLookupCandidateGenerator(max_tokens=k)}
    times = {}
    for name, drafter in drafters.items():
        drafter.prefill(sequences[:, :row_tokens], mask)
        times[name] = cpu_ms(lambda: drafter.propose(sequences.clone(), lengths, k))
    past = target(sequences[:, :row_tokens], use_cache=True).past_key_values
    last = sequences[:, row_tokens - 1: row_tokens]

    def plain_step():
        target(last, past_key_values=past, use_cache=True)
        past.crop(-1)  # the step's token leaves the cache again

    step = cpu_ms(plain_step, repeats=12)
    print(f"{rows} rows of {row_tokens} tokens, k = {k}, {torch.get_num_threads()} thread(s), CPU time:")
    print(f"plain decode step of the target: {step:.1f} ms")
    for name, milliseconds in times.items():
        print(f"{name} proposal: {milliseconds:.2f} ms ({milliseconds / step:.1%} of a plain step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="humaneval-edit,extraction")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--strategy", default="fixed")
    parser.add_argument("--tree-width", default="1",
                        help="comma list: suffix drafts at each tetris_tree_width (1: chains; w > 1: trees of the w "
                             "most voted continuations, the same k nodes verified a row with fixed)")
    parser.add_argument("--min-prob", default=str(TetrisOptions.tetris_suffix_min_prob),
                        help="comma list: suffix drafts at each tetris_suffix_min_prob (0: every cell found)")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--time-proposal", action="store_true", help="time one proposal on the host instead")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--row-tokens", type=int, default=600)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target, tokenizer = load_target()
    if args.time_proposal:
        time_proposal(target, args.rows, args.row_tokens, args.k)
        return
    results = {}
    print(f"k = {args.k}, {args.strategy}, stream of {args.max_batch_size} rows, {args.max_new_tokens} new tokens")
    print(f"{'prompts':<16} {'drafter':<18} {'tok/row-step':>12} {'rows accepting':>14} {'draft/step':>10} "
          f"{'seconds':>8} {'rows drafting':>13} {'verified/row-step':>17}  P(cell j accepted | cells before were), j = 1..{args.k}")
    for name in args.prompts.split(","):
        texts, _ = prompt_texts(load_prompts(name), args.num_prompts, tokenizer, 256)
        prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        widths = [int(width) for width in args.tree_width.split(",")]
        runs = {"lookup": serve(target, prompts, "lookup", args.k, args.strategy, args.max_batch_size,
                                args.max_new_tokens, tokenizer.eos_token_id)}
        for width in widths:
            for min_prob in [float(value) for value in args.min_prob.split(",")]:
                label = ("suffix" if width == 1 else f"suffix w={width}") + (
                    "" if min_prob == TetrisOptions.tetris_suffix_min_prob else f" p>={min_prob:g}")
                runs[label] = serve(target, prompts, "suffix", args.k, args.strategy, args.max_batch_size,
                                    args.max_new_tokens, tokenizer.eos_token_id, width, min_prob)
        if any(run["outputs"] != runs["lookup"]["outputs"] for run in runs.values()):
            raise SystemExit(f"{name}: the drafters' greedy outputs differ")
        for drafter, run in runs.items():
            per_row_step = run["emitted"] / run["row_steps"]
            print(f"{name:<16} {drafter:<18} {per_row_step:>12.3f} {run['accepted_rows'] / run['row_steps']:>14.2f} "
                  f"{run['draft_s'] / run['step_s']:>10.3f} {run['seconds']:>8.1f} "
                  f"{run['drafting_rows'] / run['row_steps']:>13.2f} {run['verified'] / run['row_steps']:>17.2f}  "
                  + " ".join(f"{a / r:.2f}" if r else "-" for a, r in zip(run["accepted"], run["reached"])))
            results[f"{name}/{drafter}"] = {key: value for key, value in run.items() if key != "outputs"}
        rate = {drafter: run["emitted"] / run["row_steps"] for drafter, run in runs.items()}
        for drafter in runs:
            if drafter != "lookup":
                ratio = rate[drafter] / rate["lookup"]
                print(f"{name:<16} {drafter} / lookup: {ratio:.3f}x tokens per row-step (outputs identical)")
                results[f"{name}/{drafter}/ratio"] = ratio
        for drafter in runs:
            if drafter.startswith("suffix ") and "suffix" in runs:
                ratio = rate[drafter] / rate["suffix"]
                print(f"{name:<16} {drafter} / suffix chains: {ratio:.3f}x tokens per row-step")
                results[f"{name}/{drafter}/vs_chains"] = ratio
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
