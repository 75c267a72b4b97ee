"""Fusing q, k and v (and gate and up) into one oneDNN product: time per layer against the products apart.

    OMP_NUM_THREADS=2 python examples/fused_projections.py

SmolLM2-135M's shapes (hidden 576, 9 query heads and 3 key-value heads of 64, MLP 1536), random fp32 weights
reordered once as :class:`tetris_hf.cpu_kernels.OneDNNLinear` keeps them; rows as a stream's steps and prompt reads
have them. Prints microseconds a layer and whether the fused product equals the ones apart bit for bit.
"""

from __future__ import annotations

import time

import torch

HIDDEN, KV, MLP = 576, 192, 1536


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def microseconds(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(rows, HIDDEN, generator=generator)
               for name, rows in (("q", HIDDEN), ("k", KV), ("v", KV), ("gate", MLP), ("up", MLP))}
    weights["qkv"] = torch.cat([weights["q"], weights["k"], weights["v"]])
    weights["gate_up"] = torch.cat([weights["gate"], weights["up"]])
    packed = {name: torch.ops.mkldnn._reorder_linear_weight(weight, 16) for name, weight in weights.items()}
    print(f"{torch.get_num_threads()} thread(s); us a layer (apart -> fused), bitwise equal")
    for rows in (16, 48, 80, 256):
        x = torch.randn(rows, HIDDEN, generator=generator)
        line = [f"{rows:4d} rows"]
        for fused, parts in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
            apart = microseconds(lambda: [product(x, packed[name]) for name in parts])
            together = microseconds(lambda: product(x, packed[fused]))
            equal = torch.equal(torch.cat([product(x, packed[name]) for name in parts], -1), product(x, packed[fused]))
            line.append(f"{fused}: {apart:.0f} -> {together:.0f} ({'equal' if equal else 'differs'})")
        print("  ".join(line))


if __name__ == "__main__":
    main()
