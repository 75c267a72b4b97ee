"""What the loop and `adaptive` cost where drafts do not pay: plain `generate()`, the loop with speculation off
(`tetris_budget=0`) and `adaptive`, interleaved call by call on the same left-padded batches (offline default target,
the shipped draft model or EAGLE head), each system's seconds summed over every round; prints each one's speed as a
ratio to plain `generate()`'s.

    OMP_NUM_THREADS=1 python examples/plain_step_cost.py --prompts mtbench --batch-size 1 --rounds 6
    OMP_NUM_THREADS=1 python examples/plain_step_cost.py --prompts humaneval --draft eagle --batch-size 4 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.tools.bench import encode
from tetris_hf.tools.cli import load_pair, load_prompt_set, prompt_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--draft", default=None, help="the shipped draft model (default) or 'eagle'")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--batches", type=int, default=None, help="batches (default 4 at B = 1, else 2)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    target, draft, tokenizer, _ = load_pair(None, args.draft, torch.device("cpu"))
    batch_size = args.batch_size
    num_batches = args.batches or (4 if batch_size == 1 else 2)
    texts, _ = prompt_texts(load_prompt_set(args.prompts), num_batches * batch_size, tokenizer, 512)
    tokenizer.padding_side = "left"
    batches = [encode(tokenizer, texts[i : i + batch_size], target.device) for i in range(0, len(texts), batch_size)]
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    loop = dict(assistant_model=draft, custom_generate="tetris", **common)
    systems = {
        "plain generate()": lambda batch: target.generate(**batch, **common),
        "the loop, speculation off": lambda batch: target.generate(**batch, tetris_budget=0, **loop),
        "adaptive": lambda batch: target.generate(**batch, tetris_strategy="adaptive", num_assistant_tokens=2,
                                                  tetris_extra_tokens=2, **loop),
    }
    for run in systems.values():  # warm-up: first forwards, the packing probe, the cost profile
        for batch in batches:
            run(batch)
    seconds = dict.fromkeys(systems, 0.0)
    for _ in range(args.rounds):
        for batch in batches:
            for name, run in systems.items():
                started = time.perf_counter()
                run(batch)
                seconds[name] += time.perf_counter() - started
    for name, total in seconds.items():
        print(f"{name}: {total:.2f} s, {seconds['plain generate()'] / total:.3f}x plain generate()'s speed")


if __name__ == "__main__":
    main()
