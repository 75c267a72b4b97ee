"""The same systems with MKL's, oneDNN's and our panel linear kernels, side by side in one process.

    python examples/onednn_linears.py --prompts humaneval-edit --num-prompts 16 --max-new-tokens 64 --repeats 3
    python examples/onednn_linears.py --kernels mkl,onednn-unpacked,onednn     # oneDNN on the weight as it is, too
    python examples/onednn_linears.py --kernels onednn,panels --threads 2      # what the panel kernel gains

Runs static ``generate()`` in chunks and the request stream (prompt lookup, ``adaptive`` and plain, by default) on
the offline target, each repeat once with the target's ``nn.Linear`` layers as they are (MKL's ``sgemm``) and once
for each other kernel of ``--kernels``, interleaved, and prints tokens per second, each system's ratio to the first
kernel, and whether the kernels' outputs agree (greedy; fp32 results differ in the last bits, so a near-tie may flip a
token: the count says how often). ``onednn`` multiplies with oneDNN on a reordered copy of the weight (a single row
with MKL), ``onednn-unpacked`` with oneDNN on the weight as it is (what the reorder gains), ``panels`` as
:func:`tetris_hf.cpu_kernels.use_onednn_linears` switches them: our panel kernel at every row count (fp32).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from tetris_hf.cpu_kernels import OneDNNLinear, restore_linears, use_onednn_linears
from tetris_hf.tools.bench import load_lookup_target
from tetris_hf.tools.stream_bench import run_chunks, run_stream, stream_prompts


class UnpackedOneDNNLinear(OneDNNLinear):
    """oneDNN's kernel on the weight as it is (every call), one row included."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(input, self.weight, self.bias, "none", [], "")


class ReorderedOneDNNLinear(OneDNNLinear):
    """oneDNN's kernel on its reordered copy of the weight (made once), a single row on MKL's: the switched layer
    before the panel kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.numel() == input.shape[-1]:
            return F.linear(input, self.weight, self.bias)
        if "_reordered" not in self.__dict__:
            with torch.no_grad():
                self._reordered = torch.ops.mkldnn._reorder_linear_weight(self.weight, 16)
        return torch.ops.mkldnn._linear_pointwise(input, self._reordered, self.bias, "none", [], "")


KERNELS = {"mkl": None, "onednn-unpacked": UnpackedOneDNNLinear, "onednn": ReorderedOneDNNLinear,
           "panels": OneDNNLinear}


def switch(model: torch.nn.Module, kernel: str) -> int:
    """Switch ``model``'s linear layers to ``kernel`` (``"mkl"``: as they are); returns how many were switched."""
    if KERNELS[kernel] is None:
        return 0
    switched = use_onednn_linears(model)
    with torch.no_grad():
        for module in model.modules():
            if type(module) is OneDNNLinear:
                module.__class__ = KERNELS[kernel]
                module(torch.zeros(2, module.in_features))  # (the kernel's copy of the weight made now, not timed)
    return switched


def unswitch(model: torch.nn.Module) -> None:
    for module in model.modules():
        if type(module) in (UnpackedOneDNNLinear, ReorderedOneDNNLinear):
            module.__dict__.pop("_reordered", None)
            module.__class__ = OneDNNLinear
    restore_linears(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval-edit")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--systems", default="static,stream-plain,stream-lookup,stream-adaptive")
    parser.add_argument("--kernels", default="mkl,onednn,panels", help="comma list of " + ", ".join(KERNELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer, info = load_lookup_target(None, torch.device("cpu"), None, 3)
    prompts, note, eos, pad = stream_prompts(target, tokenizer, args.prompts, args.num_prompts, 2048)
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
    kernels = [kernel for kernel in args.kernels.split(",") if kernel]
    if unknown := set(kernels) - set(KERNELS):
        parser.error(f"unknown kernels {sorted(unknown)}; choose among {', '.join(KERNELS)}")
    speeds = {(name, kernel): [] for name in chosen for kernel in kernels}
    outputs = {}
    switched = 0
    for repeat in range(args.repeats):
        for kernel in kernels:
            switched = switch(target, kernel) or switched
            try:
                for name in chosen:
                    run = systems[name]()
                    speeds[name, kernel].append(sum(map(len, run.tokens)) / run.seconds)
                    outputs[name, kernel] = run.tokens
            finally:
                unswitch(target)
        print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {kernel} {speeds[name, kernel][-1]:.1f}"
                                                   for name in chosen for kernel in kernels), flush=True)
    print(f"\n{switched} linear layers switched; median of {args.repeats} interleaved repeats; ratios to {kernels[0]}")
    print(f"{'system':<18}" + "".join(f"{kernel + ' tok/s':>24}" for kernel in kernels) + f"{'rows equal':>12}")
    for name in chosen:
        medians = [statistics.median(speeds[name, kernel]) for kernel in kernels]
        cells = [f"{m:.1f}" + ("" if i == 0 else f" ({m / medians[0]:.2f}x)") for i, m in enumerate(medians)]
        same = sum(all(rows[0] == row for row in rows[1:])
                   for rows in zip(*(outputs[name, kernel] for kernel in kernels)))
        print(f"{name:<18}" + "".join(f"{cell:>24}" for cell in cells) + f"{same:>8}/{len(prompts)}")

if __name__ == "__main__":
    main()
