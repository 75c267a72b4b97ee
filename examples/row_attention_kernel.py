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
import functools
import os
import statistics

from tetris_hf import cpu_attention
from tetris_hf.tools import stream_arms

ARMS = {"sdpa": "0", "kernel": "1"}  # the arm's TETRIS_HF_CPU_KERNELS


def use(setting: str) -> None:
    os.environ[cpu_attention.ENVIRONMENT] = setting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_arms.add_arguments(parser)
    args = parser.parse_args()
    if not cpu_attention.available():
        raise SystemExit("the CPU attention kernel could not be built here (see the log above): nothing to compare")
    stream = stream_arms.StreamArms(args)
    before = os.environ.get(cpu_attention.ENVIRONMENT)
    try:
        speeds, outputs = stream.interleaved({arm: functools.partial(use, setting) for arm, setting in ARMS.items()})
    finally:
        if before is None:
            os.environ.pop(cpu_attention.ENVIRONMENT, None)
        else:
            os.environ[cpu_attention.ENVIRONMENT] = before
    print(f"\nmedian of {args.repeats} interleaved repeats, tok/s (per repeat: kernel / sdpa)")
    for name in stream.systems:
        sdpa, kernel = speeds[name, "sdpa"], speeds[name, "kernel"]
        ratios = ", ".join(f"{k / s:.2f}" for k, s in zip(kernel, sdpa))
        equal = sum(a == b for a, b in zip(outputs[name, "sdpa"], outputs[name, "kernel"]))
        print(f"{name:<16} sdpa {statistics.median(sdpa):7.1f}  kernel {statistics.median(kernel):7.1f}  "
              f"{statistics.median(kernel) / statistics.median(sdpa):.2f}x ({ratios}); rows equal {equal}/"
              f"{len(outputs[name, 'sdpa'])}")


if __name__ == "__main__":
    main()
