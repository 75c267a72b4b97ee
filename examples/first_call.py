"""What `adaptive` pays in a process's first call: plain `generate()` and `adaptive` on the same prompts, alternating,
one prompt at a time (B = 1), on the offline default pair; prints each call's ratio to plain and how many of its steps
drafted. `--save-memory FILE` keeps what this process learnt; `--load-memory FILE` starts from it (see
`tetris_hf.save_pair_memory`). Run it in a fresh process each time: the first call is the one that learns.

    OMP_NUM_THREADS=1 python examples/first_call.py --prompts humaneval --num-prompts 2 --save-memory /tmp/pair.pt
    OMP_NUM_THREADS=1 python examples/first_call.py --prompts humaneval --num-prompts 2 --load-memory /tmp/pair.pt
"""

import argparse
import time

import torch

import tetris_hf
from tetris_hf.tools.cli import load_pair, load_prompt_set, prompt_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--save-memory", help="save what adaptive learnt to this file at the end")
    parser.add_argument("--load-memory", help="start adaptive from a file --save-memory wrote")
    args = parser.parse_args()
    target, draft, tokenizer, _ = load_pair(None, None, torch.device("cpu"))
    texts, _ = prompt_texts(load_prompt_set(args.prompts), args.num_prompts, tokenizer, 1000)
    prompts = [tokenizer(text, return_tensors="pt")["input_ids"] for text in texts]
    common = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    target.generate(prompts[0][:, :8], attention_mask=torch.ones_like(prompts[0][:, :8]), max_new_tokens=2,
                    do_sample=False)  # the target's first forwards, which no strategy should be charged for
    if args.load_memory:
        tetris_hf.load_pair_memory(target, draft, args.load_memory)
    for call, prompt in enumerate(prompts):
        mask = torch.ones_like(prompt)
        started = time.perf_counter()
        plain = target.generate(prompt, attention_mask=mask, **common)
        plain_seconds = time.perf_counter() - started
        drafted = []
        started = time.perf_counter()
        out = target.generate(prompt, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                              tetris_strategy="adaptive", num_assistant_tokens=4, tetris_extra_tokens=2,
                              tetris_step_callback=lambda record, loop: drafted.append(record.num_drafted), **common)
        seconds = time.perf_counter() - started
        assert torch.equal(out, plain), "adaptive's output differs from plain generate()'s"
        print(f"call {call + 1}: {plain_seconds / seconds:.2f}x plain ({seconds:.2f} s against {plain_seconds:.2f} s); "
              f"{sum(k > 0 for k in drafted)} of {len(drafted)} steps drafted")
    if args.save_memory:
        print(f"saved {tetris_hf.save_pair_memory(target, draft, args.save_memory)}")


if __name__ == "__main__":
    main()
