"""The same systems with MKL's and with oneDNN's linear kernels, side by side in one process.

    python examples/onednn_linears.py --prompts humaneval-edit --num-prompts 16 --max-new-tokens 64 --repeats 3

Runs static ``generate()`` in chunks and the request stream (prompt lookup, ``adaptive`` and plain, by default) on
the offline target, each repeat once with the target's ``nn.Linear`` layers as they are (MKL's ``sgemm``) and once
switched to oneDNN (:func:`tetris_hf.cpu_kernels.use_onednn_linears`), interleaved, and prints tokens per second,
each system's ratio oneDNN / MKL, and whether the two kernels' outputs agree (greedy; fp32 results differ in the last
bits, so a near-tie may flip a token: the count says how often).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tetris_hf.cpu_kernels import restore_linears, use_onednn_linears
from tetris_hf.tools.bench import load_lookup_target
from tetris_hf.tools.cli import load_prompt_set, prompt_texts
from tetris_hf.tools.stream_bench import run_chunks, run_stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval-edit")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--systems", default="static,stream-plain,stream-lookup,stream-adaptive")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer, info = load_lookup_target(None, torch.device("cpu"), None, 3)
    texts, note = prompt_texts(load_prompt_set(args.prompts), args.num_prompts, tokenizer, 2048)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    eos = {int(target.generation_config.eos_token_id)} if isinstance(target.generation_config.eos_token_id, int) \
        else set(target.generation_config.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    lookup = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3)
    systems = {
        "static": lambda: run_chunks("static", target, prompts, args.max_new_tokens, args.max_batch_size, eos, pad),
        "stream-plain": lambda: run_stream("stream-plain", target, prompts, args.max_new_tokens, args.max_batch_size,
                                           eos, pad, tetris_budget=0, **lookup),
        "stream-lookup": lambda: run_stream("stream-lookup", target, prompts, args.max_new_tokens,
                                            args.max_batch_size, eos, pad, tetris_strategy="fixed", **lookup),
        "stream-adaptive": lambda: run_stream("stream-adaptive", target, prompts, args.max_new_tokens,
                                              args.max_batch_size, eos, pad, tetris_strategy="adaptive", **lookup),
    }
    chosen = [name for name in args.systems.split(",") if name]
    print(f"{len(prompts)} requests ({note}), up to {args.max_new_tokens} new, {args.max_batch_size} rows, "
          f"{args.threads} thread(s)\n{info}")
    speeds = {(name, kernel): [] for name in chosen for kernel in ("mkl", "onednn")}
    outputs = {}
    for repeat in range(args.repeats):
        for kernel in ("mkl", "onednn"):
            if kernel == "onednn":
                switched = use_onednn_linears(target)
            for name in chosen:
                run = systems[name]()
                speeds[name, kernel].append(sum(map(len, run.tokens)) / run.seconds)
                outputs[name, kernel] = run.tokens
            if kernel == "onednn":
                restore_linears(target)
        print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {kernel} {speeds[name, kernel][-1]:.1f}"
                                                   for name in chosen for kernel in ("mkl", "onednn")), flush=True)
    print(f"\n{switched} linear layers switched; median of {args.repeats} interleaved repeats")
    print(f"{'system':<18}{'MKL tok/s':>11}{'oneDNN tok/s':>14}{'ratio':>8}{'rows equal':>12}")
    for name in chosen:
        mkl, onednn = (statistics.median(speeds[name, kernel]) for kernel in ("mkl", "onednn"))
        same = sum(a == b for a, b in zip(outputs[name, "mkl"], outputs[name, "onednn"]))
        print(f"{name:<18}{mkl:>11.1f}{onednn:>14.1f}{onednn / mkl:>7.2f}x{same:>8}/{len(prompts)}")


if __name__ == "__main__":
    main()
