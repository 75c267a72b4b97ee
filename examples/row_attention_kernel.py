"""The request stream with its decode and verify attention on the row-walking CPU kernel and on sdpa, side by side in
one process.

    OMP_NUM_THREADS=2 python examples/row_attention_kernel.py --prompts sharegpt --num-prompts 16 --repeats 3

A step's attention on sdpa reads every row over the cache's whole written prefix (the longest row's span), masked;
the kernel (:mod:`tetris_hf.cpu_attention`) reads each row's own visible slots only (docs/benchmarks.md, "Each row over
its own keys"). This script runs the stream on the offline target, without speculation and with prompt lookup
(``fixed``), each repeat once per arm, interleaved, and prints each system's median tok/s, the ratio, and how many
rows' outputs equal the sdpa arm's (the kernel's sums round differently from sdpa's: equal greedy tokens are expected,
not guaranteed, as between any two attention kernels).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from tetris_hf import cpu_attention
from tetris_hf.cpu_kernels import use_onednn_linears
from tetris_hf.tools.bench import load_lookup_target
from tetris_hf.tools.stream_bench import run_stream, stream_prompts

ARMS = {"sdpa": "0", "kernel": "1"}  # the arm's TETRIS_HF_CPU_KERNELS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="stream-plain,stream-lookup")
    parser.add_argument("--onednn-linears", action="store_true", help="the target's linears on oneDNN")
    args = parser.parse_args()
    if not cpu_attention.available():
        raise SystemExit("the CPU attention kernel could not be built here (see the log above): nothing to compare")
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
    before = os.environ.get(cpu_attention.ENVIRONMENT)
    try:
        for name in chosen:  # warm-up (the kernel is built here, if it was not cached)
            run(name, 2)
        for repeat in range(args.repeats):
            for arm, setting in ARMS.items():
                os.environ[cpu_attention.ENVIRONMENT] = setting
                for name in chosen:
                    result = run(name, args.max_new_tokens)
                    speeds[name, arm].append(sum(map(len, result.tokens)) / result.seconds)
                    outputs[name, arm] = result.tokens
            print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {arm} {speeds[name, arm][-1]:.1f}"
                                                       for name in chosen for arm in ARMS), flush=True)
    finally:
        if before is None:
            os.environ.pop(cpu_attention.ENVIRONMENT, None)
        else:
            os.environ[cpu_attention.ENVIRONMENT] = before
    print(f"\nmedian of {args.repeats} interleaved repeats, tok/s (per repeat: kernel / sdpa)")
    for name in chosen:
        sdpa, kernel = speeds[name, "sdpa"], speeds[name, "kernel"]
        ratios = ", ".join(f"{k / s:.2f}" for k, s in zip(kernel, sdpa))
        equal = sum(a == b for a, b in zip(outputs[name, "sdpa"], outputs[name, "kernel"]))
        print(f"{name:<16} sdpa {statistics.median(sdpa):7.1f}  kernel {statistics.median(kernel):7.1f}  "
              f"{statistics.median(kernel) / statistics.median(sdpa):.2f}x ({ratios}); rows equal {equal}/"
              f"{len(outputs[name, 'sdpa'])}")


if __name__ == "__main__":
    main()
