"""Does the target answer the ``extraction`` prompts in their format? Greedy answers of the offline target to the set
as shipped (the answer started with the JSON object's first key, ``EXTRACTION_ANSWER_START``) and to the same
prompts without that start; for each, how many answers are a JSON object holding ``"name"`` and how many reach the
``"arguments"`` key within ``--max-new-tokens``.

    python examples/extraction_format.py --num-prompts 164 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from tetris_hf.tools.data import load_prompts, render_prompts
from tetris_hf.tools.models import load_target


def answers(target, tokenizer, texts: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy answers to ``texts``, ``batch_size`` left-padded prompts at a time."""
    tokenizer.padding_side = "left"
    decoded = []
    for first in range(0, len(texts), batch_size):
        batch = tokenizer(texts[first:first + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = target.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        decoded += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return decoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=164)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    target, tokenizer = load_target()
    shipped = list(load_prompts("extraction", limit=args.num_prompts))
    for label, prompts in (("without the answer start", [replace(prompt, answer_start="") for prompt in shipped]),
                           ("as shipped, answer started", shipped)):
        texts = render_prompts(prompts, tokenizer)
        written = [prompt.answer_start + answer for prompt, answer in
                   zip(prompts, answers(target, tokenizer, texts, args.max_new_tokens, args.batch_size))]
        bodies = [answer.lstrip().removeprefix("```json").lstrip() for answer in written]
        objects = sum(body.startswith("{") and '"name"' in body for body in bodies)
        keys = sum('"arguments"' in answer for answer in written)
        print(f"{label}: {objects}/{len(prompts)} answers are a JSON object with \"name\", {keys}/{len(prompts)} "
              f"reach \"arguments\" (first answer: {written[0][:80]!r})", flush=True)


if __name__ == "__main__":
    main()
