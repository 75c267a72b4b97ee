"""``tetris_compile=True``: the target's verify forward and the draft's one-token step through ``torch.compile``.

Prompt reads and catch-ups stay eager (each has its own length, and runs once). On CUDA the mode is
``"reduce-overhead"``: CUDA graphs, which record one graph per distinct input shape. So the step forwards see a few
shapes only (:class:`~tetris_hf.kv.SlotCache` in static mode):

- the KV width: the cache's whole capacity, fixed for the call (:func:`static_capacity`), unwritten slots masked;
- the block: the target's verify block padded to a power of two on CUDA (:func:`block_width`, by the loop; a CPU
  compiles each of its at most ``k + e + 1`` widths), the draft's 1 or 2;
- the batch: padded with dummy rows to :func:`batch_bucket` (the call's batch size, then 16, 4: powers of four), so
  rows retiring change the shape only when the batch drops a bucket.

On CUDA a call with batch ``B`` and blocks up to ``2^j`` gives the target at most ``(j + 1) * len(batch_buckets(B))``
shapes, however many tokens it generates (B = 16 drafting up to 5 tokens a row, blocks of up to 8: 4 x 2 = 8); on a
CPU, with ``K = k + e`` drafts a row, at most ``(K + 1) * len(batch_buckets(B))`` (6 x 2 = 12). The draft sees at
most ``2 * len(batch_buckets(B))``. Calls whose caches round to the same capacity, and batches that share buckets,
reuse them.

The forwards are compiled with ``dynamic=False`` (:data:`DYNAMIC`): each shape is one graph, specialised. Dynamic
shapes would compile fewer graphs for as many CUDA graphs, but each compile takes longer and the steps run slower
(measured in ``docs/gpu.md``). Models that take the 2D mask of real slots
(ALiBi, attention implementations other than sdpa and eager) keep the shapes as they come, compiled with dynamic
shapes. The slot caches are allocated once, so their addresses stay put between steps.

Refused where it cannot work: a quantized (bitsandbytes) model, whose kernels ``torch.compile`` does not trace, and a
model offloaded to the CPU or disk by accelerate, whose hooks move weights inside the forward.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator

import torch

_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = weakref.WeakKeyDictionary()


def check_compilable(model: torch.nn.Module, role: str) -> None:
    """Refuse ``tetris_compile=True`` for a model it cannot serve, naming why and what to do instead."""
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None) is not None:
        raise ValueError(f"tetris_compile=True: the {role} is quantized ({type(model).__name__} with a "
                         "quantization_config); torch.compile does not trace its kernels. Use tetris_compile=False")
    placement = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
    offloaded = placement & {"cpu", "disk"}
    if offloaded and len(placement) > 1:
        raise ValueError(f"tetris_compile=True: the {role} is offloaded to {sorted(offloaded)} by accelerate, whose "
                         "hooks move weights during the forward. Use tetris_compile=False or place it on one device")


DYNAMIC = False  # static shapes: one specialised graph per shape (see the module docstring)
CAPACITY_STEP = 256  # a static cache's capacity is a multiple of this
BATCH_BUCKET_BASE = 4  # below the call's batch size, padded batches are powers of this (4, 16, 64, ...)


def compiled_forward(model: torch.nn.Module) -> Callable:
    """``model.forward`` compiled for the loop's step forwards (one compilation per model, kept while it lives)."""
    if model not in _COMPILED:
        from .kv import AttentionLayout

        # every transformers forward shares one decorator code object, whose compiled variants (target, draft, batch
        # sizes) count against one dynamo cache: 8 by default, past which it silently runs eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        on_cuda = next(model.parameters()).is_cuda
        static = AttentionLayout.of(model).prepared  # (else the 2D mask: shapes as they come, see kv.SlotCache)
        _COMPILED[model] = torch.compile(model.forward, dynamic=DYNAMIC if static else True,
                                         mode="reduce-overhead" if on_cuda else None)
    return _COMPILED[model]


def bucket(length: int) -> int:
    """The padded length of a block of ``length`` tokens: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(length - 1, 0).bit_length()


def records_graphs(device: torch.device) -> bool:
    """Whether compiled forwards on ``device`` run as CUDA graphs (``mode="reduce-overhead"``, see
    :func:`compiled_forward`), which record one graph per shape: then blocks are padded to :func:`bucket` widths."""
    return device.type == "cuda"


def block_width(length: int, compiled: bool, device: torch.device) -> int:
    """The width of a step's target block of ``length`` tokens: padded to a power of two where compiled forwards
    record CUDA graphs (few shapes matter more than the filler's cost, which a GPU hardly notices), else ``length``.

    Elsewhere (inductor on a CPU) each width is compiled once, and a block has at most ``k + e + 1`` widths however
    long the call, while filler tokens cost what real ones cost: padding a fixed ``k = 2`` block of 3 to 4 would add a
    third to every verify forward.
    """
    return bucket(length) if compiled and records_graphs(device) else length


def batch_bucket(rows: int, batch_size: int) -> int:
    """The padded batch of a compiled step with ``rows`` active rows in a call of ``batch_size`` rows: the least power
    of four (4, 16, 64, ...) that holds them, at most ``batch_size``.

    E.g. ``batch_size`` 16: 5..16 rows run as 16, 1..4 as 4. On a GPU a decoding forward reads the weights whatever
    its batch, so a few padded rows cost little, and fewer buckets mean fewer graphs.
    """
    padded = BATCH_BUCKET_BASE
    while padded < rows:
        padded *= BATCH_BUCKET_BASE
    return min(padded, batch_size)


def batch_buckets(batch_size: int) -> list[int]:
    """Every padded batch :func:`batch_bucket` gives in a call of ``batch_size`` rows, largest first."""
    return sorted({batch_bucket(rows, batch_size) for rows in range(1, batch_size + 1)}, reverse=True)


def static_capacity(slots: int) -> int:
    """Slots per row of a cache whose steps are compiled: ``slots`` rounded up to a multiple of
    :data:`CAPACITY_STEP`, so that calls of nearby lengths give the compiled forwards the same shapes."""
    return -(-slots // CAPACITY_STEP) * CAPACITY_STEP


GROUPED_SDPA = "tetris_grouped_sdpa"  # the attention the static step runs on sdpa models (see grouped_attention)


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, but a key-value head is read in place by its group of query heads
    (``enable_gqa``). transformers does that only without a mask; with one it expands the keys and values to every
    query head first, which over a static cache's whole capacity is most of a compiled CPU step's generated work
    (docs/gpu.md). ``query`` ``(B, H, L, D)``, ``key``/``value`` ``(B, H_kv, W, D)``; returns ``(B, L, H, D)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    unusual = any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks"))
    if getattr(module, "num_key_value_groups", 1) == 1 or unusual or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                              dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


@functools.cache
def _register_grouped_sdpa() -> None:
    """Register :func:`grouped_sdpa_attention` (and sdpa's masks) under :data:`GROUPED_SDPA`, once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


@contextlib.contextmanager
def grouped_attention(model: torch.nn.Module) -> Iterator[None]:
    """While a static step's compiled forward runs: a model on transformers' ``"sdpa"`` attention runs
    :func:`grouped_sdpa_attention` instead (registered under :data:`GROUPED_SDPA`, with sdpa's masks); others as
    they are. The model's setting is restored after, so its eager forwards are untouched."""
    config = model.config
    if config._attn_implementation != "sdpa":
        yield
        return
    _register_grouped_sdpa()
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
