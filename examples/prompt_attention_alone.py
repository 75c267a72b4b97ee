"""Prompts' causal attention alone, as a forward that reads prompts runs it: the C kernel
(:func:`tetris_hf.cpu_attention.prompt_attention`) against torch's sdpa row by row (what
:func:`tetris_hf.attention.prompt_rows_attention` runs with ``TETRIS_HF_CPU_KERNELS=0``), every layer's tensors in turn.

    OMP_NUM_THREADS=2 python examples/prompt_attention_alone.py --lengths 147,282,512,1300 --rows 1
    OMP_NUM_THREADS=2 python examples/prompt_attention_alone.py --code-edits     # the first 16 code edits' lengths

Each case is ``--rows`` prompts of one length (or, with ``--code-edits``, 16 prompts of 144-282 tokens, the lengths
the side by side's first read holds), 9 query heads on 3 key-value heads of 64 dimensions (SmolLM2-135M's) unless
told otherwise, ``--layers`` layers' queries, keys and values made apart. Prints, per case, each path's ms a layer
(the best of ``--repeats`` passes over all layers after one untimed pass) and its GFLOP/s of causal attention
(``4 * heads * dim * length * (length + 1) / 2`` a prompt), and checks both against softmax attention in float64 (the
script raises otherwise). Measurements: docs/benchmarks.md, "Prompts' attention in tiles".
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tetris_hf import cpu_attention, kernel_build
from tetris_hf.attention import prompt_rows_attention

CODE_EDITS = (144, 145, 151, 152, 179, 196, 198, 199, 206, 211, 216, 224, 230, 269, 274, 282)


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """Each row's causal softmax attention in float64, ``(N, H, D)`` in the packed order."""
    outputs, token = [], 0
    for row, length in enumerate(lengths):
        queries = query[:, :, token : token + length].double()
        token += length
        keys, values = key[row : row + 1, :, :length].double(), value[row : row + 1, :, :length].double()
        output = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                                                  enable_gqa=True)
        outputs.append(output[0].transpose(0, 1))
    return torch.cat(outputs)


def attend(layers, lengths: tuple[int, ...], kernel: bool) -> list[torch.Tensor]:
    """Every layer's attention on the kernel (``kernel``) or on sdpa row by row (the C kernels switched off)."""
    previous = os.environ.get(kernel_build.ENVIRONMENT)
    os.environ[kernel_build.ENVIRONMENT] = "1" if kernel else "0"
    try:
        with torch.no_grad():
            return [prompt_rows_attention(query, key, value, lengths, None, max(lengths))
                    for query, key, value in layers]
    finally:
        if previous is None:
            del os.environ[kernel_build.ENVIRONMENT]
        else:
            os.environ[kernel_build.ENVIRONMENT] = previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="147,282,512,1300", help="prompt lengths, one case each")
    parser.add_argument("--code-edits", action="store_true", help="one case: the first 16 code edits' lengths")
    parser.add_argument("--rows", type=int, default=1, help="prompts of each length in a case")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--key-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not cpu_attention.available():
        raise SystemExit("no C compiler found (gcc or $CC): no kernel to time")
    cases = [CODE_EDITS] if args.code_edits else [(int(length),) * args.rows for length in args.lengths.split(",")]
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {args.heads} query heads on {args.key_heads}, dim {args.dim}, "
          f"{args.layers} layers")
    for lengths in cases:
        tokens, slots = sum(lengths), max(lengths)
        layers = [(torch.randn(1, args.heads, tokens, args.dim, generator=generator),
                   torch.randn(len(lengths), args.key_heads, slots, args.dim, generator=generator),
                   torch.randn(len(lengths), args.key_heads, slots, args.dim, generator=generator))
                  for _ in range(args.layers)]
        expected = reference(*layers[0], lengths)
        flops = sum(4 * args.heads * args.dim * length * (length + 1) / 2 for length in lengths)
        cells = []
        for name, kernel in (("sdpa row by row", False), ("kernel", True)):
            torch.testing.assert_close(attend(layers[:1], lengths, kernel)[0].double(), expected, atol=2e-5,
                                       rtol=1e-4)
            attend(layers, lengths, kernel)
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                attend(layers, lengths, kernel)
                best = min(best, (time.perf_counter() - started) / args.layers)
            cells.append((name, best))
        described = f"{len(lengths)} x {lengths[0]}" if len(set(lengths)) == 1 else f"{len(lengths)} prompts"
        line = ", ".join(f"{name} {seconds * 1000:.3f} ms a layer ({flops / seconds / 1e9:.0f} GFLOP/s)"
                         for name, seconds in cells)
        print(f"{described} ({tokens} tokens): {line}; kernel / sdpa {cells[1][1] / cells[0][1]:.2f}x the time")


if __name__ == "__main__":
    main()
