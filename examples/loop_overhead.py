"""What the speculative loop costs on its own: plain ``generate()`` against ``tetris_budget=0`` (the loop, drafting
nothing), on the offline default pair, with the time inside the target's forward calls split from the rest.

    python examples/loop_overhead.py --batch-size 16 --max-new-tokens 32 --repeats 5

Prints, per run (medians over the interleaved repeats): wall seconds, seconds inside the target's forwards (and its
first, the prompt), the number of forwards, and the seconds outside them (preparation, logits processing, stopping,
the loop's bookkeeping).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.cli import load_prompt_set, prompt_texts
from tetris_hf.models import load_default_pair


class ForwardTimer:
    """Seconds a model spends inside its forward calls (and in its first call), via hooks."""

    def __init__(self, model: torch.nn.Module):
        self.seconds = self.first_seconds = 0.0
        self.calls = 0
        self._started = 0.0
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave)

    def reset(self) -> None:
        self.seconds = self.first_seconds = 0.0
        self.calls = 0

    def _enter(self, *_):
        self._started = time.perf_counter()

    def _leave(self, *_):
        elapsed = time.perf_counter() - self._started
        self.first_seconds += elapsed if self.calls == 0 else 0.0
        self.seconds += elapsed
        self.calls += 1


def measure(target, draft, batch: dict, max_new_tokens: int, pad_token_id: int, repeats: int) -> dict[str, dict]:
    """Both runs, interleaved ``repeats`` times after a warm-up; per run the medians of ``wall``, ``forwards``
    (seconds inside the target's forwards), ``prompt`` (its first forward) and ``outside``, and ``calls``."""
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    runs = {"plain generate()": {},
            "tetris_budget=0": dict(assistant_model=draft, custom_generate="tetris", tetris_budget=0)}
    timer = ForwardTimer(target)
    target.generate(**batch, **common)  # warm-up
    measured: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, extra in runs.items():
            timer.reset()
            started = time.perf_counter()
            target.generate(**batch, **common, **extra)
            measured[name].append((time.perf_counter() - started, timer.seconds, timer.first_seconds, timer.calls))
    summary = {}
    for name, rows in measured.items():
        median = statistics.median
        summary[name] = {"wall": median(r[0] for r in rows), "forwards": median(r[1] for r in rows),
                         "prompt": median(r[2] for r in rows), "outside": median(r[0] - r[1] for r in rows),
                         "calls": rows[0][3]}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, draft, tokenizer, _ = load_default_pair()
    tokenizer.padding_side = "left"
    texts, _ = prompt_texts(load_prompt_set("sharegpt"), args.batch_size, tokenizer, 128)
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    summary = measure(target, draft, batch, args.max_new_tokens, tokenizer.pad_token_id, args.repeats)
    print(f"batch {args.batch_size}, {args.max_new_tokens} new tokens, median of {args.repeats} interleaved repeats")
    print(f"{'run':<18} {'wall s':>8} {'forwards s':>11} {'prompt s':>9} {'forwards':>9} {'outside s':>10}")
    for name, row in summary.items():
        print(f"{name:<18} {row['wall']:>8.3f} {row['forwards']:>11.3f} {row['prompt']:>9.3f} {row['calls']:>9} "
              f"{row['outside']:>10.3f}")


if __name__ == "__main__":
    main()
