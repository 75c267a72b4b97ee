"""The offline target's request stream under two or more settings ("arms"), side by side in one process: each repeat
runs every arm once, interleaved, so that a noisy machine slows them alike (examples/long_context_attention.py,
examples/row_attention_kernel.py, examples/compiled_eager_shapes.py). :func:`add_arguments` the scripts' shared
flags, :class:`StreamArms` the target and prompts loaded once and the interleaved runs.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Mapping

import torch

from ..cpu_kernels import use_onednn_linears
from .bench import load_lookup_target
from .stream_bench import StreamRun, run_stream, stream_prompts

SYSTEMS = {"stream-plain": dict(tetris_budget=0), "stream-lookup": dict(tetris_strategy="fixed")}
LOOKUP = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3)


def add_arguments(parser: argparse.ArgumentParser, prompts: str = "sharegpt") -> None:
    """The flags every arm script takes (``prompts``: the default prompt set)."""
    parser.add_argument("--prompts", default=prompts)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument("--onednn-linears", action="store_true", help="the target's linears on oneDNN")


class StreamArms:
    """The offline target (SmolLM2-135M-Instruct) and the prompts of ``args``, loaded once; its systems: the stream
    without speculation (``stream-plain``) and with prompt lookup, ``fixed`` (``stream-lookup``). Prints what it
    loaded."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.target, tokenizer, info = load_lookup_target(None, torch.device("cpu"), None, 3)
        if args.onednn_linears:
            use_onednn_linears(self.target)
        self.prompts, note, self.eos, self.pad = stream_prompts(self.target, tokenizer, args.prompts,
                                                                args.num_prompts, args.max_prompt_tokens)
        self.systems = [name for name in args.systems.split(",") if name]
        unknown = sorted(set(self.systems) - set(SYSTEMS))
        if unknown:
            raise SystemExit(f"--systems: {unknown} unknown (choose from {', '.join(SYSTEMS)})")
        lengths = sorted(map(len, self.prompts))
        print(f"{len(self.prompts)} requests ({note}), prompts of {lengths[0]}-{lengths[-1]} tokens (median "
              f"{statistics.median(lengths):.0f}), up to {args.max_new_tokens} new, {args.max_batch_size} rows, "
              f"{torch.get_num_threads()} thread(s), linears on {'oneDNN' if args.onednn_linears else 'MKL'}\n{info}")

    def run(self, system: str, new_tokens: int, **options) -> StreamRun:
        """One run of ``system`` over every prompt, at most ``new_tokens`` each; ``options``: more of the stream's
        generation options (e.g. ``tetris_compile=True``; eager unless given, so that arms compare what they
        change)."""
        options = {"tetris_compile": False, **options}
        return run_stream(system, self.target, self.prompts, new_tokens, self.args.max_batch_size, self.eos, self.pad,
                          **LOOKUP, **SYSTEMS[system], **options)

    def interleaved(self, arms: Mapping[str, Callable[[], None]]) -> tuple[dict, dict]:
        """A warm-up, then ``args.repeats`` repeats, each running every system under every arm (``arms[name]()``
        switches to it) once, in order; prints each repeat's tok/s.

        Returns:
            ``({(system, arm): [tok/s of each repeat]}, {(system, arm): the last repeat's tokens of each request}``.
        """
        for system in self.systems:
            self.run(system, 2)
        speeds = {(system, arm): [] for system in self.systems for arm in arms}
        outputs = {}
        for repeat in range(self.args.repeats):
            for arm, use in arms.items():
                use()
                for system in self.systems:
                    result = self.run(system, self.args.max_new_tokens)
                    speeds[system, arm].append(sum(map(len, result.tokens)) / result.seconds)
                    outputs[system, arm] = result.tokens
            print(f"repeat {repeat + 1}: " + ", ".join(f"{system} {arm} {speeds[system, arm][-1]:.1f}"
                                                       for system in self.systems for arm in arms), flush=True)
        return speeds, outputs
