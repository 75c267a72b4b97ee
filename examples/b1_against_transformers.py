"""One request at a time (B = 1): the loop against transformers' own assisted generation and prompt lookup, with the
time of every step split into the target's forwards, the draft's forwards and everything else.

    OMP_NUM_THREADS=1 python examples/b1_against_transformers.py --prompts mtbench --k 2
    OMP_NUM_THREADS=1 python examples/b1_against_transformers.py --prompts humaneval-edit --lookup --k 8

With a draft model it runs plain ``generate()``; transformers' assisted generation as it comes (``hf-assisted``: the
assistant's defaults, up to 20 drafts a step, drafting stopped once the draft's top probability falls below 0.4);
transformers drafting exactly ``k`` a step (``hf-assisted k``: ``num_assistant_tokens=k``, a constant schedule, no
confidence stop: the algorithm ``fixed`` runs); and the loop's ``fixed`` and ``adaptive`` at ``k``. With ``--lookup``:
plain ``generate()``, transformers' prompt lookup and ``fixed``, at ``k``. Every run is repeated ``--repeats`` times,
interleaved; printed per run, its median repeat: seconds, the ratio to plain ``generate()``, tokens per step (per target
forward), draft forwards per step, and milliseconds per step inside the target's forwards, inside the draft's and
outside both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.tools.bench import encode, load_lookup_target
from tetris_hf.tools.cli import load_pair, load_prompt_set, prompt_texts


class ForwardTimer:
    """Seconds a model spends inside its forward calls, and how many calls, via hooks."""

    def __init__(self, model: torch.nn.Module | None):
        self.seconds, self.calls, self._started = 0.0, 0, 0.0
        if model is not None:
            model.register_forward_pre_hook(self._enter)
            model.register_forward_hook(self._leave)

    def _enter(self, *_):
        self._started = time.perf_counter()

    def _leave(self, *_):
        self.seconds += time.perf_counter() - self._started
        self.calls += 1


def assistant_settings(draft, k: int | None) -> None:
    """The assistant's generation config: transformers' defaults (``k`` None), or exactly ``k`` drafts a step."""
    config = draft.generation_config
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = None if k is None else "constant"
    config.assistant_confidence_threshold = None if k is None else 0.0


def runs(draft, k: int) -> dict[str, dict]:
    """Every run by name: its ``generate()`` keyword arguments (``_k``: the assistant's drafts a step, or None)."""
    if draft is None:  # prompt lookup
        lookup = dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)
        return {"plain generate()": {}, f"hf-lookup k={k}": lookup,
                f"fixed k={k}": dict(lookup, custom_generate="tetris", tetris_strategy="fixed")}
    ours = dict(assistant_model=draft, custom_generate="tetris", num_assistant_tokens=k)
    return {"plain generate()": {}, "hf-assisted": dict(assistant_model=draft, _k=None),
            f"hf-assisted k={k}": dict(assistant_model=draft, _k=k),
            f"fixed k={k}": dict(ours, tetris_strategy="fixed"), f"adaptive k={k}": dict(ours, tetris_strategy="adaptive")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--lookup", action="store_true", help="prompt lookup instead of the shipped draft model")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.lookup:
        (target, tokenizer, _), draft = load_lookup_target(None, device, None, 3), None
    else:
        target, draft, tokenizer, _ = load_pair(None, None, device, None)
    texts, _ = prompt_texts(load_prompt_set(args.prompts), args.num_prompts, tokenizer, 256)  # as the bench
    target_timer, draft_timer = ForwardTimer(target), ForwardTimer(draft)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)

    def call(options: dict) -> tuple[float, ...]:
        options = dict(options)
        if "_k" in options:
            assistant_settings(draft, options.pop("_k"))
        target_timer.seconds = draft_timer.seconds = 0.0
        target_timer.calls = draft_timer.calls = 0
        started, tokens = time.perf_counter(), 0
        for text in texts:
            batch = encode(tokenizer, [text], device)
            tokens += target.generate(**batch, **options, **common).shape[1] - batch["input_ids"].shape[1]
        return (time.perf_counter() - started, tokens, target_timer.calls, target_timer.seconds, draft_timer.calls,
                draft_timer.seconds)

    named = runs(draft, args.k)
    for options in named.values():  # warm-up (and adaptive's cost profile)
        call(options)
    measured = {name: [] for name in named}
    for _ in range(args.repeats):
        for name, options in named.items():
            measured[name].append(call(options))
    plain = statistics.median(row[0] for row in measured["plain generate()"])
    print(f"{args.prompts}, {len(texts)} prompts one at a time, {args.max_new_tokens} new tokens, "
          f"the median of {args.repeats} interleaved repeats")
    print(f"{'run':<18} {'s':>6} {'x plain':>7} {'tok/step':>8} {'draft fwd/step':>14} "
          f"{'ms/step: target':>15} {'draft':>6} {'outside':>8}")
    for name, rows in measured.items():
        seconds, tokens, steps, target_s, draft_calls, draft_s = sorted(rows)[len(rows) // 2]  # the median run
        print(f"{name:<18} {seconds:>6.2f} {plain / seconds:>6.2f}x {tokens / steps:>8.2f} {draft_calls / steps:>14.2f} "
              f"{1e3 * target_s / steps:>15.1f} {1e3 * draft_s / steps:>6.1f} "
              f"{1e3 * (seconds - target_s - draft_s) / steps:>8.2f}")


if __name__ == "__main__":
    main()
