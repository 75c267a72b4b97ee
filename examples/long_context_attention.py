"""The stream's attention on long contexts, before and after, side by side in one process.

    OMP_NUM_THREADS=1 python examples/long_context_attention.py --prompts sharegpt --num-prompts 16 --repeats 3

Two changes, each with the same sums bit for bit (docs/benchmarks.md, "Attention over long contexts"):

- **prompt rows one by one**: a request stream reads the prompts of the rows that join in packed forwards (a prompt
  chunk of its own, or riding in a step's verification forward). Their attention used to be unpacked to a block as
  wide as the longest prompt, every row computed to that width, rows without a token in the chunk included; on the
  CPU each prompt row is now attended on its own, at its own length (:func:`tetris_hf.attention.prompt_rows_attention`).
- **query heads folded**: a masked block of 3 or more queries a row (a verified draft block) runs with each key-value
  head's query heads as one block of queries (:func:`tetris_hf.attention.fold_queries`), where ``enable_gqa`` ran
  each query head apart.

This script runs the request stream on the offline target, without speculation and with prompt lookup (``fixed``),
each repeat once per arm ("before": neither; "rows": prompt rows only; "after": both), interleaved, and prints each
system's median tok/s, the ratios to "before", and whether every arm's outputs equal "before"'s. ``--profile`` also
times every sdpa call of one more run per arm, by kind.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time

import torch

import tetris_hf.attention as attention
import tetris_hf.packing as packing
from tetris_hf.tools import stream_arms

# each arm: (the narrowest prompt block read row by row, the most queries a key-value head folded)
ARMS = {"before": (sys.maxsize, 0), "rows": (packing.ROW_BY_ROW_WIDTH, 0),
        "after": (packing.ROW_BY_ROW_WIDTH, attention.FOLDED_QUERIES)}


def use(arm: str) -> None:
    packing.ROW_BY_ROW_WIDTH, attention.FOLDED_QUERIES = ARMS[arm]


def attention_times(run) -> dict[str, tuple[int, float]]:
    """``run()`` with every sdpa call timed: ``{kind: (calls, seconds)}``. Kinds: a prompt block padded ("prompt,
    causal": rows that just joined; "prompt, masked": a later chunk), a prompt row read alone ("prompt, row by row"),
    and the rest ("step": decode and verify blocks, folded or not)."""
    functional = torch.nn.functional
    sdpa, rows_alone = functional.scaled_dot_product_attention, packing.prompt_rows_attention
    times: dict = collections.defaultdict(lambda: [0, 0.0])
    inside = [False]

    def timed(query, key, value, attn_mask=None, *args, is_causal=False, **kwargs):
        started = time.perf_counter()
        output = sdpa(query, key, value, attn_mask, *args, is_causal=is_causal, **kwargs)
        if inside[0]:
            kind = "prompt, row by row"
        elif query.shape[1] != key.shape[1] and query.shape[-2] >= ARMS["after"][0]:  # (a padded prompt block)
            kind = "prompt, causal" if is_causal else "prompt, masked"
        else:
            kind = "step"
        times[kind][0] += 1
        times[kind][1] += time.perf_counter() - started
        return output

    def row_by_row(*args, **kwargs):
        inside[0] = True
        try:
            return rows_alone(*args, **kwargs)
        finally:
            inside[0] = False

    functional.scaled_dot_product_attention, packing.prompt_rows_attention = timed, row_by_row
    try:
        run()
    finally:
        functional.scaled_dot_product_attention, packing.prompt_rows_attention = sdpa, rows_alone
    return {kind: tuple(entry) for kind, entry in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_arms.add_arguments(parser, prompts="humaneval-edit")
    parser.add_argument("--profile", action="store_true", help="also time every attention call, by kind")
    args = parser.parse_args()
    stream = stream_arms.StreamArms(args)
    prompts, chosen = stream.prompts, stream.systems
    try:
        speeds, outputs = stream.interleaved({arm: functools.partial(use, arm) for arm in ARMS})
        if args.profile:
            print("\nattention calls of one more run per arm (calls, seconds)")
            for name in chosen:
                for arm in ARMS:
                    use(arm)
                    times = attention_times(lambda: stream.run(name, args.max_new_tokens))
                    print(f"{name} {arm}: " + ", ".join(f"{kind} {calls} {seconds:.2f} s" for kind, (calls, seconds)
                                                        in sorted(times.items())))
    finally:
        use("after")
    print(f"\nmedian of {args.repeats} interleaved repeats (tok/s; ratio to before; rows equal to before's)")
    print(f"{'system':<16}" + "".join(f"{arm:>22}" for arm in ARMS))
    for name in chosen:
        before = statistics.median(speeds[name, "before"])
        cells = []
        for arm in ARMS:
            speed = statistics.median(speeds[name, arm])
            same = sum(a == b for a, b in zip(outputs[name, "before"], outputs[name, arm]))
            cells.append(f"{speed:.1f} ({speed / before:.2f}x, {same}/{len(prompts)})")
        print(f"{name:<16}" + "".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
    main()
