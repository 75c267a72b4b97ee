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

from tetris_hf.cpu_kernels import use_onednn_linears
from tetris_hf.tools import stream_bench
from tetris_hf.tools.models import load_target

LOOKUP = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3, tetris_extra_tokens=2, tetris_strategy="fixed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval-edit")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="then one compiled run under torch.profiler")
    args = parser.parse_args()
    target, tokenizer = load_target(None)
    use_onednn_linears(target)
    prompts, note, eos, pad = stream_bench.stream_prompts(target, tokenizer, args.prompts, args.num_prompts, 2048)

    def serve(compiled: bool):
        with torch.no_grad():
            return stream_bench.run_stream("stream", target, prompts, args.max_new_tokens, 16, eos, pad,
                                           tetris_compile=compiled, **LOOKUP)

    print(f"{len(prompts)} requests ({note}), {torch.get_num_threads()} thread(s)")
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
