"""``tetris_compile=True``: the target's verify forward and the draft's one-token step through ``torch.compile``
(:func:`compiled_forward`; on CUDA as CUDA graphs, on the shapes of :mod:`tetris_hf.static_shapes`), and what it
refuses (:func:`check_compilable`). Design and measurements: docs/gpu.md, "The compiled path".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .attention import AttentionLayout
from .cpu_kernels import OneDNNLinear

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


DYNAMIC = False  # static shapes: one specialised graph per shape (why: docs/gpu.md)


def compiled_forward(model: torch.nn.Module) -> Callable:
    """``model.forward`` compiled for the loop's step forwards (one compilation per model, kept while it lives)."""
    if model not in _COMPILED:
        # every transformers forward shares one decorator code object, whose compiled variants (target, draft, batch
        # sizes) count against one dynamo cache: 8 by default, past which it silently runs eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        on_cuda = next(model.parameters()).is_cuda
        static = AttentionLayout.of(model).prepared  # (else the 2D mask: shapes as they come)
        compiled = torch.compile(model.forward, dynamic=DYNAMIC if static else True,
                                 mode="reduce-overhead" if on_cuda else None)
        switched = [module for module in model.modules() if type(module) is OneDNNLinear]
        if switched:  # the reordered weights a graph reads, made (or remade, if a weight changed) before each call
            def compiled(*args, _forward=compiled, **kwargs):
                for module in switched:
                    module._kernel_weight()
                return _forward(*args, **kwargs)
        _COMPILED[model] = compiled
    return _COMPILED[model]
