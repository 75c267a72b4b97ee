"""Joining prompts attended row by row, each at its own length, against the padded block, side by side.

    OMP_NUM_THREADS=1 python examples/prompt_rows.py --prompts sharegpt --num-prompts 16 --repeats 3

A request stream reads the prompts of the rows that join in packed forwards (a prompt chunk of its own, or riding in
a step's verification forward). The packed tokens' attention used to be unpacked to a block as wide as the longest
prompt, every row computed to that width, rows without a token in the chunk included; on the CPU it now reads each
prompt row on its own (:func:`tetris_hf.attention.prompt_rows_attention`), with the same sums. This script runs the
request stream on the offline target, without speculation and with prompt lookup (``fixed``), each repeat once with
the padded block ("before") and once row by row ("after"), interleaved in one process, and prints each system's
median tok/s, the ratio after / before, and whether the two arms' outputs are equal (they should be, token for token).
``--profile`` also times every attention call of one more run per arm, by kind (docs/benchmarks.md, "Attention over
long contexts").
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch

import tetris_hf.packing as packing
from tetris_hf.cpu_kernels import use_onednn_linears
from tetris_hf.tools.bench import load_lookup_target
from tetris_hf.tools.stream_bench import run_stream, stream_prompts

ARMS = {"before": sys.maxsize, "after": packing.ROW_BY_ROW_WIDTH}  # the narrowest block read row by row


def attention_times(run) -> dict[str, tuple[int, float]]:
    """``run()`` with every sdpa call timed: ``{kind: (calls, seconds)}``, kinds by what the call computes."""
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention
    times: dict = collections.defaultdict(lambda: [0, 0.0])

    def timed(query, key, value, attn_mask=None, *args, is_causal=False, **kwargs):
        started = time.perf_counter()
        output = sdpa(query, key, value, attn_mask, *args, is_causal=is_causal, **kwargs)
        queries = query.shape[-2] * (query.shape[1] // key.shape[1] if query.shape[1] != key.shape[1] else 1)
        kind = ("prompt, causal" if is_causal else "prompt, masked") if query.shape[-2] > 8 else "step"
        entry = times[kind if queries > 0 else "step"]
        entry[0] += 1
        entry[1] += time.perf_counter() - started
        return output

    functional.scaled_dot_product_attention = timed
    try:
        run()
    finally:
        functional.scaled_dot_product_attention = sdpa
    return {kind: tuple(entry) for kind, entry in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval-edit")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="stream-plain,stream-lookup")
    parser.add_argument("--onednn-linears", action="store_true", help="the target's linears on oneDNN")
    parser.add_argument("--profile", action="store_true", help="also time every attention call, by kind")
    args = parser.parse_args()
    target, tokenizer, info = load_lookup_target(None, torch.device("cpu"), None, 3)
    if args.onednn_linears:
        use_onednn_linears(target)
    prompts, note, eos, pad = stream_prompts(target, tokenizer, args.prompts, args.num_prompts, args.max_prompt_tokens)
    lookup = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3)
    options = {"stream-plain": dict(tetris_budget=0), "stream-lookup": dict(tetris_strategy="fixed")}
    chosen = [name for name in args.systems.split(",") if name]
    lengths = sorted(map(len, prompts))
    print(f"{len(prompts)} requests ({note}), prompts of {lengths[0]}-{lengths[-1]} tokens (median "
          f"{statistics.median(lengths):.0f}), up to {args.max_new_tokens} new, {args.max_batch_size} rows, "
          f"{torch.get_num_threads()} thread(s), linears on {'oneDNN' if args.onednn_linears else 'MKL'}\n{info}")

    def run(name: str, new_tokens: int):
        return run_stream(name, target, prompts, new_tokens, args.max_batch_size, eos, pad, **lookup, **options[name])

    speeds = {(name, arm): [] for name in chosen for arm in ARMS}
    outputs = {}
    try:
        for name in chosen:  # warm-up
            run(name, 2)
        for repeat in range(args.repeats):
            for arm, width in ARMS.items():
                packing.ROW_BY_ROW_WIDTH = width
                for name in chosen:
                    result = run(name, args.max_new_tokens)
                    speeds[name, arm].append(sum(map(len, result.tokens)) / result.seconds)
                    outputs[name, arm] = result.tokens
            print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {arm} {speeds[name, arm][-1]:.1f}"
                                                       for name in chosen for arm in ARMS), flush=True)
        if args.profile:
            print("\nattention calls of one more run per arm (calls, seconds)")
            for name in chosen:
                for arm, width in ARMS.items():
                    packing.ROW_BY_ROW_WIDTH = width
                    times = attention_times(lambda: run(name, args.max_new_tokens))
                    print(f"{name} {arm}: " + ", ".join(f"{kind} {calls} {seconds:.2f} s" for kind, (calls, seconds)
                                                        in sorted(times.items())))
    finally:
        packing.ROW_BY_ROW_WIDTH = ARMS["after"]
    print(f"\nmedian of {args.repeats} interleaved repeats")
    print(f"{'system':<18}{'before tok/s':>14}{'after tok/s':>13}{'ratio':>8}{'rows equal':>12}")
    for name in chosen:
        before, after = (statistics.median(speeds[name, arm]) for arm in ARMS)
        same = sum(a == b for a, b in zip(outputs[name, "before"], outputs[name, "after"]))
        print(f"{name:<18}{before:>14.1f}{after:>13.1f}{after / before:>7.2f}x{same:>8}/{len(prompts)}")


if __name__ == "__main__":
    main()
