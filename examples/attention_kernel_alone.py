"""The CPU attention kernel alone, as a step reads it: every layer's cache in turn (cold, as in a forward), one block of
queries a row, against the memory's speed and, optionally, against the kernel of another commit.

    OMP_NUM_THREADS=2 python examples/attention_kernel_alone.py --contexts 128,512,2048 --queries 1,5 \\
        --against 3081c35

Each layer's keys and values are ``(rows, key_heads, context + 64, dim)`` buffers (a cache's, read in place), the
queries a packed block of ``queries`` tokens a row, causal among themselves (a decode step: 1; a verify step: more).
Prints, per shape, each kernel's ms a layer (the best of ``--repeats`` passes over all layers after one untimed pass)
and the GB/s of keys and values it read, beside "cold sum": ``torch.sum`` over the same keys and values, layer after
layer, what two threads read from memory without arithmetic. ``--against REV`` builds ``REV``'s kernel source
(``git show REV:tetris_hf/row_attention_source.py``) with the same compiler flags and times it in turn with this
tree's. Every kernel's output is checked against softmax attention in float64. Measurements: docs/benchmarks.md,
"Decode steps against vLLM's at equal contexts".
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tetris_hf import cpu_attention, kernel_build
from tetris_hf.row_attention_source import SOURCE


def built(source: str, folder: Path, name: str):
    """``source`` built and loaded as :mod:`tetris_hf.cpu_attention` builds its own: its ``row_attention``."""
    command = kernel_build.compiler()
    if command is None:
        raise SystemExit("no C compiler found (gcc or $CC): no kernel to time")
    library = folder / f"{name}.so"
    kernel_build.build(source, library, command)
    return cpu_attention.load(library).row_attention


def layers_of(args, context: int, queries: int):
    """Each layer's ``(keys, values)``, the packed queries ``(1, H, rows * queries, D)``, the mask ``(rows, 1,
    queries, capacity)`` (every cached slot, then causal over the block's) and the packing's ``ends``, ``columns``."""
    generator = torch.Generator().manual_seed(0)
    capacity = context + 64
    shape = (args.rows, args.key_heads, capacity, args.dim)
    caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(args.layers)]
    query = torch.randn(1, args.key_heads * args.groups, args.rows * queries, args.dim, generator=generator)
    mask = torch.zeros(args.rows, 1, queries, capacity, dtype=torch.bool)
    mask[..., : context - queries] = True
    for position in range(queries):
        mask[:, :, position, context - queries : context - queries + position + 1] = True
    ends = torch.arange(1, args.rows + 1) * queries
    columns = torch.arange(queries).repeat(args.rows)
    return caches, query, mask, ends, columns


def reference(query, key, value, mask, rows: int, queries: int) -> torch.Tensor:
    """Softmax attention in float64, ``(rows * queries, H, D)``."""
    heads, dim = query.shape[1], query.shape[3]
    groups = heads // key.shape[1]
    keys, values = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    blocks = query[0].view(heads, rows, queries, dim).permute(1, 0, 2, 3).double()
    scores = (blocks @ keys.transpose(-1, -2) * dim ** -0.5).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values).permute(0, 2, 1, 3).reshape(rows * queries, heads, dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="128,512,2048", help="cached keys a row, comma list")
    parser.add_argument("--queries", default="1,5", help="queries a row (block length), comma list")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--key-heads", type=int, default=3)
    parser.add_argument("--groups", type=int, default=3, help="query heads a key-value head")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--against", default=None, help="a git revision whose kernel to time beside this tree's")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as scratch:
        kernels = {"this tree": built(SOURCE, Path(scratch), "this")}
        if args.against:
            text = subprocess.run(["git", "show", f"{args.against}:tetris_hf/row_attention_source.py"], check=True,
                                  capture_output=True, text=True).stdout
            namespace: dict = {}
            exec(compile(text, "row_attention_source.py", "exec"), namespace)
            kernels[args.against] = built(namespace["SOURCE"], Path(scratch), "against")
        print(f"{args.rows} rows, {args.key_heads} key-value heads x {args.groups} query heads, dim {args.dim}, "
              f"{args.layers} layers, {threads} threads; ms a layer (GB/s of keys and values read)")
        for queries in map(int, args.queries.split(",")):
            for context in map(int, args.contexts.split(",")):
                caches, query, mask, ends, columns = layers_of(args, context, queries)
                flags = mask.view(torch.uint8)
                output = torch.empty(args.rows * queries, query.shape[1], args.dim)

                def call(kernel, key, value):
                    kernel(query.data_ptr(), 0, query.stride(1), query.stride(2), key.data_ptr(), *key.stride()[:3],
                           value.data_ptr(), *value.stride()[:3], flags.data_ptr(), flags.stride(0),
                           flags.stride(2) if queries > 1 else 0, flags.stride(3), output.data_ptr(), args.rows,
                           query.shape[1], args.key_heads, queries, key.shape[2], args.dim, args.dim ** -0.5,
                           threads, ends.data_ptr(), columns.data_ptr(), 0)

                passes = {name: (lambda kernel=kernel: [call(kernel, *cache) for cache in caches])
                          for name, kernel in kernels.items()}
                passes["cold sum"] = lambda: [(key[:, :, :context].sum(), value[:, :, :context].sum())
                                              for key, value in caches]
                for name, kernel in kernels.items():
                    call(kernel, *caches[0])
                    expected = reference(query, *caches[0], mask, args.rows, queries)
                    torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=1e-4)
                best = {name: float("inf") for name in passes}
                for repeat in range(args.repeats + 1):
                    for name, run in passes.items():  # (in turn: a noisy machine slows each alike)
                        started = time.perf_counter()
                        run()
                        seconds = (time.perf_counter() - started) / args.layers
                        best[name] = min(best[name], seconds) if repeat else best[name]
                read = 2 * args.rows * args.key_heads * context * args.dim * 4
                cells = "  ".join(f"{name} {1e3 * seconds:.3f} ({read / seconds / 1e9:.1f})"
                                  for name, seconds in best.items())
                print(f"{queries} queries a row, {context:5d} keys: {cells}", flush=True)


if __name__ == "__main__":
    main()
