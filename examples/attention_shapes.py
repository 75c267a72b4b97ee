"""One layer's attention at the request stream's shapes (SmolLM2-135M: 9 query heads on 3 key-value heads of 64),
each way the stream could run it, in microseconds: a table.

    OMP_NUM_THREADS=1 python examples/attention_shapes.py

"cold" cycles through 30 layers' caches (as a step does: a layer's keys are no longer in the CPU's caches when it
comes round again), "warm" repeats one layer. The lengths are the 16 ShareGPT first turns of the stream bench (33 to
407 tokens) plus 50 generated: a decode step's keys span the longest row's slots, every row attends over all of them
(the holes masked), where the loop's kernel (tetris_hf/cpu_attention.py) reads each row's own. docs/benchmarks.md,
"Attention over long contexts (a later stop)" and "Each row over its own keys (a later stop)".
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tetris_hf import cpu_attention
from tetris_hf.attention import prompt_rows_attention

ROWS, HEADS, KV_HEADS, DIM, LAYERS = 16, 9, 3, 64, 30
PROMPTS = [33, 37, 38, 40, 42, 46, 47, 47, 48, 63, 79, 81, 92, 145, 373, 407]
GENERATED = 50


def per_call(function, layers: int, repeats: int = 5) -> float:
    """The best of ``repeats`` passes of ``function(layer)`` over ``layers`` layers: microseconds a call."""
    best = float("inf")
    function(0)
    for _ in range(repeats):
        started = time.perf_counter()
        for layer in range(layers):
            function(layer)
        best = min(best, (time.perf_counter() - started) / layers)
    return best * 1e6


def main() -> None:
    torch.manual_seed(0)
    span = max(PROMPTS) + GENERATED + 10  # the pointer: the longest row, a few holes
    keys = [torch.randn(ROWS, KV_HEADS, 768, DIM) for _ in range(LAYERS)]  # (a cache's buffers: capacity 768)
    values = [torch.randn(ROWS, KV_HEADS, 768, DIM) for _ in range(LAYERS)]
    real = torch.zeros(ROWS, span, dtype=torch.bool)
    for row, length in enumerate(PROMPTS):
        real[row, :length] = True
        real[row, span - GENERATED :] = True
    lines = []

    def row(what: str, shape: str, function, cold: bool = True) -> None:
        lines.append((what, shape, per_call(function, LAYERS if cold else 1)))

    # a decode step: 1 query a row, transformers' single-query fold (9 heads as 3 x 3 queries), under the row mask
    query = torch.randn(ROWS, KV_HEADS, HEADS // KV_HEADS, DIM)
    mask = real[:, None, None]
    for cold in (True, False):
        row(f"decode, every row over the longest span ({'cold' if cold else 'warm'})", f"16 x 1 x {span}",
            lambda layer: F.scaled_dot_product_attention(query, keys[layer][:, :, :span], values[layer][:, :, :span],
                                                         attn_mask=mask), cold)
    row("decode, mask of floats", f"16 x 1 x {span}",
        lambda layer: F.scaled_dot_product_attention(query, keys[layer][:, :, :span], values[layer][:, :, :span],
                                                     attn_mask=torch.zeros(ROWS, 1, 1, span).masked_fill(
                                                         ~mask, float("-inf"))))
    row("decode, no mask (what masking costs)", f"16 x 1 x {span}",
        lambda layer: F.scaled_dot_product_attention(query, keys[layer][:, :, :span], values[layer][:, :, :span]))
    spread = torch.randn(ROWS, HEADS, 1, DIM)
    row("decode, one query a head (enable_gqa)", f"16 x 1 x {span}",
        lambda layer: F.scaled_dot_product_attention(spread, keys[layer][:, :, :span], values[layer][:, :, :span],
                                                     attn_mask=mask, enable_gqa=True))
    row("decode, keys and values copied first (.contiguous())", f"16 x 1 x {span}",
        lambda layer: (keys[layer][:, :, :span].contiguous(), values[layer][:, :, :span].contiguous()))
    own = [length + GENERATED for length in PROMPTS]

    def own_spans(layer: int) -> None:
        for index, length in enumerate(own):
            F.scaled_dot_product_attention(query[index : index + 1], keys[layer][index : index + 1, :, :length],
                                           values[layer][index : index + 1, :, :length])

    row("decode, each row over its own tokens only (vLLM's reads)", f"16 x 1 x {min(own)}-{max(own)}", own_spans)
    if cpu_attention.available():  # the loop's kernel: each row over the slots its mask lets it see
        heads = query.reshape(ROWS, HEADS, 1, DIM)
        row("decode, the row-walking kernel (cpu_attention)", f"16 x 1 x {span}",
            lambda layer: cpu_attention.row_attention(heads, keys[layer][:, :, :span], values[layer][:, :, :span],
                                                      mask))
    for length in (5, 8):  # a verified block: lookup's k = 4 and one more
        block = torch.randn(ROWS, length, HEADS, DIM).transpose(1, 2)
        block_mask = torch.cat([real[:, None, None, : span - length].expand(ROWS, 1, length, span - length),
                                torch.ones(length, length, dtype=torch.bool).tril().expand(ROWS, 1, length, length)],
                               dim=-1)
        row("verify block, enable_gqa (one block a query head)", f"16 x {length} x {span}",
            lambda layer: F.scaled_dot_product_attention(block, keys[layer][:, :, :span], values[layer][:, :, :span],
                                                         attn_mask=block_mask, enable_gqa=True))
        folded_mask = block_mask.repeat(1, 1, HEADS // KV_HEADS, 1)
        row("verify block, query heads folded (one block a key-value head)", f"16 x {length} x {span}",
            lambda layer: F.scaled_dot_product_attention(block.reshape(ROWS, KV_HEADS, -1, DIM),
                                                         keys[layer][:, :, :span], values[layer][:, :, :span],
                                                         attn_mask=folded_mask))
        if cpu_attention.available():
            row("verify block, the row-walking kernel (cpu_attention)", f"16 x {length} x {span}",
                lambda layer: cpu_attention.row_attention(block, keys[layer][:, :, :span],
                                                          values[layer][:, :, :span], block_mask))
    # the prompts' first chunk (256 tokens a forward): the padded block against row by row
    chunk = [min(length - 1, 256) for length in PROMPTS]
    width = max(chunk)
    padded = torch.randn(ROWS, HEADS, width, DIM)
    packed = torch.randn(1, HEADS, sum(chunk), DIM)
    row("prompt chunk, padded to the longest (causal)", f"16 x {width} x {width}",
        lambda layer: F.scaled_dot_product_attention(padded, keys[layer][:, :, :width], values[layer][:, :, :width],
                                                     is_causal=True, enable_gqa=True))
    row("prompt chunk, row by row (prompt_rows_attention)", f"16 x {min(chunk)}-{width} x own",
        lambda layer: prompt_rows_attention(packed, keys[layer][:, :, :width], values[layer][:, :, :width],
                                            tuple(chunk), None, width))
    print(f"one layer, {torch.get_num_threads()} thread(s), rows x queries a row x keys; microseconds a call")
    print(f"{'what':<64}{'shape':>22}{'us':>8}")
    for what, shape, micros in lines:
        print(f"{what:<64}{shape:>22}{micros:>8.0f}")


if __name__ == "__main__":
    main()
