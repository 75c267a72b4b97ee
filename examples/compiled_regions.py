"""The request stream eager, and with only its norms and MLPs compiled (dynamic shapes, the rest eager), interleaved.

    OMP_NUM_THREADS=2 python examples/compiled_regions.py --prompts humaneval-edit --num-prompts 16 --repeats 2

What fusing the elementwise ops between the linear layers gains when the attention, the cache and the loop stay
eager (the whole-step compiled path, ``tetris_compile=True``, pads its verify blocks instead). Every model linear on
oneDNN (as the stream bench's ``--onednn-linears``); prints tok/s per system and arm and whether outputs agree.
Measured: docs/benchmarks.md, "The side by side with oneDNN compiled".
"""

from __future__ import annotations

import argparse
import time

import torch

from tetris_hf.cpu_kernels import use_onednn_linears
from tetris_hf.tools.bench import load_lookup_target
from tetris_hf.tools.stream_bench import run_stream, stream_prompts

REGIONS = ("RMSNorm", "MLP")  # class-name endings of the modules compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval-edit")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target, tokenizer, _ = load_lookup_target(None, torch.device("cpu"), None, 3)
    use_onednn_linears(target)
    prompts, note, eos, pad = stream_prompts(target, tokenizer, args.prompts, args.num_prompts, 2048)
    lookup = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3)
    systems = {"stream-plain": dict(tetris_budget=0, **lookup), "stream-fixed": dict(tetris_strategy="fixed", **lookup)}
    regions = [module for module in target.modules() if type(module).__name__.endswith(REGIONS)]
    eager = {module: module.forward for module in regions}
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled = {module: torch.compile(module.forward, dynamic=True) for module in regions}

    def arm(name: str) -> None:
        for module in regions:
            module.forward = compiled[module] if name == "regions" else eager[module]

    def serve(system: str):
        return run_stream(system, target, prompts, args.max_new_tokens, 16, eos, pad, **systems[system])

    print(f"{len(prompts)} requests ({note}), {torch.get_num_threads()} thread(s), {len(regions)} regions compiled")
    arm("regions")
    start = time.perf_counter()
    for system in systems:
        serve(system)
    print(f"compile run: {time.perf_counter() - start:.0f} s (not counted)")
    for repeat in range(args.repeats):
        for system in systems:
            outputs = {}
            for name in ("eager", "regions"):
                arm(name)
                run = serve(system)
                outputs[name] = run.tokens
                print(f"repeat {repeat + 1} {system} {name}: {sum(map(len, run.tokens)) / run.seconds:.1f} tok/s",
                      flush=True)
            equal = sum(a == b for a, b in zip(outputs["eager"], outputs["regions"]))
            print(f"  outputs equal: {equal}/{len(prompts)}")
    arm("eager")


if __name__ == "__main__":
    main()
