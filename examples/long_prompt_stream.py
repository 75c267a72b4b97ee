"""The request stream with speculation off against transformers' `generate_batch` on long prompts: ShareGPT first
turns of up to 2,048 tokens, 16 rows, greedy, on the offline default target. The stream runs twice: reading prompts
longer than `prefill_chunk` in chunks of 256, and whole (2,048, the default: every prompt rides in a verification
forward). Prints each run's tokens a second and, per repeat, its ratio to `generate_batch`'s (interleaved repeats).

    OMP_NUM_THREADS=1 python examples/long_prompt_stream.py --num-prompts 32 --max-new-tokens 32 --repeats 2
"""

from __future__ import annotations

import argparse
import time

import torch

from tetris_hf.continuous import generate_batch
from tetris_hf.tools.cli import load_prompt_set, prompt_texts
from tetris_hf.tools.models import load_target
from tetris_hf.tools.stream_bench import run_hf_generate_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target, tokenizer = load_target(None)
    texts, _ = prompt_texts(load_prompt_set("sharegpt"), args.num_prompts, tokenizer, 2048)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]  # (chats rendered already)
    eos = {tokenizer.eos_token_id}
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, the longest {max(map(len, prompts))}")

    def stream(chunk: int):
        def run() -> int:
            outputs = generate_batch(target, prompts, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     max_batch_size=args.max_batch_size, prompt_lookup_num_tokens=4, tetris_budget=0,
                                     prefill_chunk=chunk, eos_token_id=sorted(eos))
            return sum(len(output.generated_tokens) for output in outputs.values())
        return run

    def hf_generate_batch() -> int:
        run = run_hf_generate_batch(target, prompts, args.max_new_tokens, args.max_batch_size, eos,
                                    tokenizer.pad_token_id or 0)
        return sum(map(len, run.tokens))

    systems = {"generate_batch": hf_generate_batch, "stream, chunks of 256": stream(256),
               "stream, whole prompts": stream(2048)}
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        for name, run in systems.items():
            started = time.perf_counter()
            tokens = run()
            rates[name].append(tokens / (time.perf_counter() - started))
            print(f"repeat {repeat + 1}: {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    for name, values in rates.items():
        ratios = ", ".join(f"{value / base:.2f}x" for value, base in zip(values, rates["generate_batch"]))
        print(f"{name}: {ratios} generate_batch")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
