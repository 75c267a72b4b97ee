"""What the speculative loop costs on its own: plain ``generate()`` against the loop drafting nothing
(``tetris_budget=0``) and drafting (fixed k = 2, TETRIS k = 2, e = 2), on the offline default pair, with the time
inside the models' forward calls split from the rest.

    python examples/loop_overhead.py --batch-size 16 --max-new-tokens 32 --repeats 5

Prints, per run (medians over the interleaved repeats): wall seconds, seconds inside the target's forwards (and its
first, the prompt), seconds inside the draft's forwards, the number of target forwards (steps), and the seconds
outside every forward, in all and per step (preparation, logits processing, stopping, the loop's bookkeeping).

``--compiled`` adds fixed and TETRIS with ``tetris_compile=True`` (``... compiled``; the first, warm-up call compiles)
and prints every speculative run's steady step: the median time between the ends of two steps, the call's first two
steps left out. (A compiled forward does not run the models' hooks, so its forward columns are left empty.)

``--compare-with DIR`` also runs the loop of another checkout (``DIR/tetris_hf``, e.g. ``git worktree add
/tmp/before <commit>``) in the same process, interleaved with this one's, and prints the change in the loop's own
time per step: a ratio measured side by side, which the noise between processes (5-10% here) does not blur.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.tools.cli import load_prompt_set, prompt_texts
from tetris_hf.tools.models import load_default_pair


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


BEFORE = " [before]"  # the suffix of a run of the --compare-with checkout


def load_other_checkout(tree: str | Path, name: str = "tetris_hf_before"):
    """The package ``tree/tetris_hf`` of another checkout, imported as ``name`` (its modules import each other
    relatively, so both versions live side by side); this checkout's ``custom_generate="tetris"`` stays registered."""
    init = Path(tree) / "tetris_hf" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--compare-with {tree}: no tetris_hf/__init__.py there (a checkout's root is expected)")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    tetris_hf.register()  # importing it registered its own custom_generate="tetris"
    return package


COMPILED = " compiled"  # the suffix of a run with tetris_compile=True


def runs_to_compare(draft, before=None, compiled: bool = False) -> dict[str, tuple]:
    """Every run by name: ``(generate function, its keyword arguments)``. The speculative runs call a package's
    ``generate`` (what ``custom_generate="tetris"`` resolves to), again with ``before``'s (another version of the
    package) when given, under the same name plus :data:`BEFORE`, and fixed and TETRIS again with
    ``tetris_compile=True`` when ``compiled`` (the name plus :data:`COMPILED`)."""
    speculative = {"tetris_budget=0": dict(tetris_budget=0),
                   "fixed k=2": dict(tetris_strategy="fixed", num_assistant_tokens=2),
                   "tetris k=2 e=2": dict(num_assistant_tokens=2, tetris_extra_tokens=2)}
    runs = {"plain generate()": (None, {})}
    for name, options in speculative.items():
        runs[name] = (tetris_hf.generate, dict(options, assistant_model=draft))
        if before is not None:
            runs[name + BEFORE] = (before.generate, dict(options, assistant_model=draft))
    if compiled:
        for name in ("fixed k=2", "tetris k=2 e=2"):
            generate, options = runs[name]
            runs[name + COMPILED] = (generate, dict(options, tetris_compile=True))
    return runs


def measure(target, draft, batch: dict, max_new_tokens: int, pad_token_id: int, repeats: int,
            before=None, compiled: bool = False) -> dict[str, dict]:
    """Every run of :func:`runs_to_compare`, interleaved ``repeats`` times after a warm-up; per run the medians of
    ``wall``, ``forwards`` (seconds inside the target's forwards), ``prompt`` (its first forward), ``draft`` (seconds
    inside the draft's forwards), ``outside`` (wall minus both) and ``outside_per_step`` (over the target's forwards),
    ``step`` (the median seconds between two steps' ends, the first two steps left out; ``None`` for plain
    ``generate()``), ``calls`` (the target's forwards in the first repeat; for compiled runs, the eager ones only) and
    ``same`` (its tokens equal plain ``generate()``'s)."""
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    runs = runs_to_compare(draft, before, compiled)
    step_ends: list[float] = []

    def call(name: str) -> torch.Tensor:
        generate, options = runs[name]
        step_ends.clear()
        if generate is None:
            return target.generate(**batch, **common)
        return generate(target, **batch, **common, **options,
                        tetris_step_callback=lambda record, loop: step_ends.append(time.perf_counter()))

    def steady_step() -> float | None:
        intervals = [later - earlier for earlier, later in zip(step_ends[2:], step_ends[3:])]
        return statistics.median(intervals) if intervals else None

    target_timer, draft_timer = ForwardTimer(target), ForwardTimer(draft)
    outputs = {name: call(name) for name in runs}  # warm-up
    measured: dict[str, list[tuple[float, float, float, float, int]]] = {name: [] for name in runs}
    steps: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name in runs:
            target_timer.reset()
            draft_timer.reset()
            started = time.perf_counter()
            call(name)
            measured[name].append((time.perf_counter() - started, target_timer.seconds, target_timer.first_seconds,
                                   draft_timer.seconds, target_timer.calls))
            step = steady_step()
            if step is not None:
                steps[name].append(step)
    median = statistics.median
    summary = {}
    for name, rows in measured.items():
        outside = [wall - forwards - drafting for wall, forwards, _, drafting, _ in rows]
        summary[name] = {"wall": median(r[0] for r in rows), "forwards": median(r[1] for r in rows),
                         "prompt": median(r[2] for r in rows), "draft": median(r[3] for r in rows),
                         "outside": median(outside),
                         "outside_per_step": median(o / r[4] for o, r in zip(outside, rows)), "calls": rows[0][4],
                         "step": median(steps[name]) if steps[name] else None,
                         "same": torch.equal(outputs[name], outputs["plain generate()"])}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft", default=None, help="a draft for load_default_pair (default: the shipped one)")
    parser.add_argument("--compiled", action="store_true",
                        help="also fixed and TETRIS with tetris_compile=True, and every run's steady step time")
    parser.add_argument("--compare-with", default=None, metavar="DIR",
                        help="another checkout's root: its loop runs too, interleaved, and the change is printed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = load_other_checkout(args.compare_with) if args.compare_with else None

    target, draft, tokenizer, _ = load_default_pair(draft=args.draft)
    tokenizer.padding_side = "left"
    texts, _ = prompt_texts(load_prompt_set("sharegpt"), args.batch_size, tokenizer, 128)
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    summary = measure(target, draft, batch, args.max_new_tokens, tokenizer.pad_token_id, args.repeats, before,
                      args.compiled)
    print(f"batch {args.batch_size}, {args.max_new_tokens} new tokens, median of {args.repeats} interleaved repeats")
    print(f"{'run':<27} {'wall s':>8} {'target s':>9} {'prompt s':>9} {'draft s':>8} {'steps':>6} "
          f"{'outside s':>10} {'outside ms/step':>16} {'step ms':>8}  tokens")
    for name, row in summary.items():
        change = ""
        if before is not None and name + BEFORE in summary:
            change = f" ({row['outside_per_step'] / summary[name + BEFORE]['outside_per_step'] - 1:+.0%} vs before)"
        if name.endswith(COMPILED):
            eager = summary[name.removesuffix(COMPILED)]
            change = f" (steady step {row['step'] / eager['step']:.2f}x eager's)"
            timed = f"{'':>9} {row['prompt']:>9.3f} {'':>8} {'':>6} {'':>10} {'':>16}"
        else:
            timed = (f"{row['forwards']:>9.3f} {row['prompt']:>9.3f} {row['draft']:>8.3f} {row['calls']:>6} "
                     f"{row['outside']:>10.3f} {1000 * row['outside_per_step']:>16.2f}")
        step = f"{1000 * row['step']:>8.1f}" if row["step"] is not None else f"{'-':>8}"
        print(f"{name:<27} {row['wall']:>8.3f} {timed} {step}  "
              f"{'= plain' if row['same'] else 'DIFFER from plain'}{change}")


if __name__ == "__main__":
    main()
