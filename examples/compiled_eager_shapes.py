"""The request stream eager against ``tetris_compile=True`` (on the CPU: compiled on eager shapes), interleaved in one
process: tok/s per repeat, graphs compiled during the timed runs, and, with ``--profile``, where a compiled run goes.

    OMP_NUM_THREADS=2 python examples/compiled_eager_shapes.py --num-prompts 32 --max-new-tokens 128 --profile

Every model linear on oneDNN (as the stream bench's ``--onednn-linears``), prompt lookup with ``fixed`` chains (k = 4,
e = 2), 16 rows, greedy fp32. A first compiled run compiles (minutes), reported apart. Measured: docs/benchmarks.md,
"Compiled steps on eager shapes".
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._dynamo.utils import counters

from tetris_hf.tools import stream_arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_arms.add_arguments(parser, prompts="humaneval-edit")
    parser.add_argument("--profile", action="store_true", help="then one compiled run under torch.profiler")
    parser.set_defaults(num_prompts=32, max_new_tokens=128, repeats=2, systems="stream-lookup", onednn_linears=True)
    args = parser.parse_args()
    stream = stream_arms.StreamArms(args)

    def serve(compiled: bool):
        with torch.no_grad():
            return stream.run("stream-lookup", args.max_new_tokens, tetris_compile=compiled)

    start = time.perf_counter()
    serve(True)
    print(f"compile run {time.perf_counter() - start:.1f} s, {counters['stats']['unique_graphs']} graphs")
    outputs = {}
    for repeat in range(args.repeats):
        for compiled in (False, True):
            graphs = counters["stats"]["unique_graphs"]
            start = time.perf_counter()
            run = serve(compiled)
            seconds = time.perf_counter() - start
            outputs[compiled] = run.tokens
            print(f"repeat {repeat + 1} {'compiled' if compiled else 'eager':8s} "
                  f"{sum(map(len, run.tokens)) / seconds:6.1f} tok/s, "
                  f"{counters['stats']['unique_graphs'] - graphs} graphs compiled in it")
    print("outputs equal:", outputs[False] == outputs[True])
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            serve(True)
        events = sorted(profiler.key_averages(), key=lambda event: -event.self_cpu_time_total)
        for event in events[:14]:
            print(f"  {event.self_cpu_time_total / 1e3:9.1f} ms {event.count:7d} calls  {event.key[:90]}")


if __name__ == "__main__":
    main()
