"""What the loop and `adaptive` cost where drafts do not pay: plain `generate()`, the loop with speculation off
(`tetris_budget=0`) and `adaptive`, interleaved call by call on the same left-padded batches (offline default target,
the shipped draft model or EAGLE head), each system's seconds summed over every round; prints each one's speed as a
ratio to plain `generate()`'s. `--trace` also prints each `adaptive` call (the warm-up's first, where the pair's
memory starts empty): its steps as a string (the tokens each step drafted a row; `p` a probe), the drafting steps'
acceptance, its speed against plain `generate()` on the same batch, and what the pair's memory holds after it (what
drafting plans realized against their predictions, a probe's measured cost in plain steps).

    OMP_NUM_THREADS=1 python examples/plain_step_cost.py --prompts mtbench --batch-size 1 --rounds 6
    OMP_NUM_THREADS=1 python examples/plain_step_cost.py --prompts humaneval --draft eagle --batch-size 4 --rounds 3
    OMP_NUM_THREADS=1 python examples/plain_step_cost.py --prompts humaneval --draft eagle --batch-size 4 --trace
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
    parser.add_argument("--trace", action="store_true", help="print each adaptive call's steps")
    args = parser.parse_args()
    target, draft, tokenizer, _ = load_pair(None, args.draft, torch.device("cpu"))
    batch_size = args.batch_size
    num_batches = args.batches or (4 if batch_size == 1 else 2)
    texts, _ = prompt_texts(load_prompt_set(args.prompts), num_batches * batch_size, tokenizer, 512)
    tokenizer.padding_side = "left"
    batches = [encode(tokenizer, texts[i : i + batch_size], target.device) for i in range(0, len(texts), batch_size)]
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    loop = dict(assistant_model=draft, custom_generate="tetris", **common)
    steps, strategies = [], []

    def record(step, core) -> None:  # (the step callback of --trace)
        steps.append(("p" if step.probe else str(step.num_drafted), int(step.num_accepted.sum()),
                      int(step.verify_lengths.sum())))
        strategies[:] = [core.strategy]

    if args.trace:
        loop["tetris_step_callback"] = record
    systems = {
        "plain generate()": lambda batch: target.generate(**batch, **common),
        "the loop, speculation off": lambda batch: target.generate(**batch, tetris_budget=0, **loop),
        "adaptive": lambda batch: target.generate(**batch, tetris_strategy="adaptive", num_assistant_tokens=2,
                                                  tetris_extra_tokens=2, **loop),
    }
    for name, run in systems.items():  # warm-up: first forwards, the packing probe, the cost profile
        for index, batch in enumerate(batches):
            steps.clear()
            run(batch)
            if args.trace and name == "adaptive":
                print(f"warm-up batch {index}: " + trace(steps, strategies[0].memory))
    seconds = dict.fromkeys(systems, 0.0)
    for round_ in range(args.rounds):
        for index, batch in enumerate(batches):
            called = {}
            for name, run in systems.items():
                steps.clear()
                started = time.perf_counter()
                run(batch)
                called[name] = time.perf_counter() - started
                seconds[name] += called[name]
            if args.trace:
                print(f"round {round_} batch {index}: " + trace(steps, strategies[0].memory,
                                                                  called["plain generate()"] / called["adaptive"]))
    for name, total in seconds.items():
        print(f"{name}: {total:.2f} s, {seconds['plain generate()'] / total:.3f}x plain generate()'s speed")


def trace(steps: list[tuple[str, int, int]], memory, speed: float | None = None) -> str:
    """One ``adaptive`` call as --trace prints it (``speed``: against plain ``generate()``'s, where timed)."""
    drafting = [step for step in steps if step[0] != "0"]
    realized = memory.realized[False]
    probe = "-" if memory.probe_cost is None else f"{memory.probe_cost:.2f}"
    timed = "" if speed is None else f"{speed:.3f}x plain  "
    return (f"adaptive {timed}{''.join(step[0] for step in steps)}  accepted "
            f"{sum(s[1] for s in drafting)} of {sum(s[2] for s in drafting)} verified; realized/predicted "
            f"{realized.tokens:.0f}/{realized.predicted:.0f}, a probe {probe} plain steps")


if __name__ == "__main__":
    main()
