"""Masked blocks of several queries with each key-value head read in place, against transformers' copy, side by side.

    OMP_NUM_THREADS=1 python examples/keys_in_place.py --prompts sharegpt --num-prompts 16 --repeats 3

On the CPU the loop's attention (:func:`tetris_hf.routing.loop_attention_forward`) runs a masked block of several
queries (a verified draft block, a prompt read beside other rows) through
:func:`tetris_hf.attention.grouped_sdpa_attention`: sdpa with ``enable_gqa``, each key-value head read by its group
of query heads where it lies. transformers' own sdpa attention copies the keys and values to every query head first
(``repeat_kv``) whenever there is a mask and more than one query. This script runs the request stream (speculation
off, prompt lookup with ``fixed``, ``adaptive``) on the offline target, each repeat once with transformers' attention
in that place ("before") and once as the package runs it ("after"), interleaved in one process, and prints each
system's median tok/s, the ratio after / before, and whether the two arms' outputs are equal (they should be: the
kernels compute the same sums).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import tetris_hf.packing as packing
from tetris_hf.tools.bench import load_lookup_target
from tetris_hf.tools.stream_bench import run_stream, stream_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval-edit")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="stream-plain,stream-lookup,stream-adaptive")
    args = parser.parse_args()
    target, tokenizer, info = load_lookup_target(None, torch.device("cpu"), None, 3)
    prompts, note, eos, pad = stream_prompts(target, tokenizer, args.prompts, args.num_prompts, args.max_prompt_tokens)
    lookup = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3)
    options = {"stream-plain": dict(tetris_budget=0), "stream-lookup": dict(tetris_strategy="fixed"),
               "stream-adaptive": dict(tetris_strategy="adaptive")}
    chosen = [name for name in args.systems.split(",") if name]
    print(f"{len(prompts)} requests ({note}), up to {args.max_new_tokens} new, {args.max_batch_size} rows, "
          f"{torch.get_num_threads()} thread(s)\n{info}")
    in_place = packing.grouped_sdpa_attention
    arms = {"before": sdpa_attention_forward, "after": in_place}
    speeds = {(name, arm): [] for name in chosen for arm in arms}
    outputs = {}
    try:
        for repeat in range(args.repeats):
            for arm, attention in arms.items():
                packing.grouped_sdpa_attention = attention  # what the loop's attention calls for such a block
                for name in chosen:
                    run = run_stream(name, target, prompts, args.max_new_tokens, args.max_batch_size, eos, pad,
                                     **lookup, **options[name])
                    speeds[name, arm].append(sum(map(len, run.tokens)) / run.seconds)
                    outputs[name, arm] = run.tokens
            print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {arm} {speeds[name, arm][-1]:.1f}"
                                                       for name in chosen for arm in arms), flush=True)
    finally:
        packing.grouped_sdpa_attention = in_place
    print(f"\nmedian of {args.repeats} interleaved repeats")
    print(f"{'system':<18}{'before tok/s':>14}{'after tok/s':>13}{'ratio':>8}{'rows equal':>12}")
    for name in chosen:
        before, after = (statistics.median(speeds[name, arm]) for arm in arms)
        same = sum(a == b for a, b in zip(outputs[name, "before"], outputs[name, "after"]))
        print(f"{name:<18}{before:>14.1f}{after:>13.1f}{after / before:>7.2f}x{same:>8}/{len(prompts)}")


if __name__ == "__main__":
    main()
