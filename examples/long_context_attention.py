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
import statistics
import sys
import time

import torch

import tetris_hf.attention as attention
import tetris_hf.packing as packing
from tetris_hf.cpu_kernels import use_onednn_linears
from tetris_hf.tools.bench import load_lookup_target
from tetris_hf.tools.stream_bench import run_stream, stream_prompts

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
            for arm in ARMS:
                use(arm)
                for name in chosen:
                    result = run(name, args.max_new_tokens)
                    speeds[name, arm].append(sum(map(len, result.tokens)) / result.seconds)
                    outputs[name, arm] = result.tokens
            print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {arm} {speeds[name, arm][-1]:.1f}"
                                                       for name in chosen for arm in ARMS), flush=True)
        if args.profile:
            print("\nattention calls of one more run per arm (calls, seconds)")
            for name in chosen:
                for arm in ARMS:
                    use(arm)
                    times = attention_times(lambda: run(name, args.max_new_tokens))
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
