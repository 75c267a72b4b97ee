# Exported from tetris_hf/compiled.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""``tetris_compile=True``: the target's verify forward and the draft's one-token step through ``torch.compile``.

Prompt reads and catch-ups stay eager (each has its own length, and runs once). The step forwards are compiled with
dynamic shapes, so the batch shrinking and the caches filling up do not recompile; the target's block is padded to a
power of two (masked filler), so on CUDA, where the mode is ``"reduce-overhead"`` (CUDA graphs), a step replays one of
a few recorded graphs. The slot caches are allocated once, so their addresses stay put between steps.

Refused where it cannot work: a quantized (bitsandbytes) model, whose kernels ``torch.compile`` does not trace, and a
model offloaded to the CPU or disk by accelerate, whose hooks move weights inside the forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

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


def compiled_forward(model: torch.nn.Module) -> Callable:
    """``model.forward`` compiled for the loop's step forwards (one compilation per model, kept while it lives)."""
    if model not in _COMPILED:
        # every transformers forward shares one decorator code object, whose compiled variants (target, draft, batch
        # sizes) count against one dynamo cache: 8 by default, past which it silently runs eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        on_cuda = next(model.parameters()).is_cuda
        _COMPILED[model] = torch.compile(model.forward, dynamic=True,
                                         mode="reduce-overhead" if on_cuda else None)
    return _COMPILED[model]


def bucket(length: int) -> int:
    """The padded length of a block of ``length`` tokens: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(length - 1, 0).bit_length()
